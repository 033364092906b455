"""Runs a guest's `main` and reports what escapes it on stderr (made by `tpubox new`).

Without it, a tpubox error (`componentize_py_types.Err` holding a WIT `error`) raised out of
`Run.run` becomes the run's failure with nothing on stderr. `entry` prints such an error as
`error: KIND: MESSAGE` with the line that raised it, any other exception as a traceback, and
ends the run with exit status 1.
"""

import sys
import traceback

from componentize_py_types import Err
from wit_world.imports import types


def kind_name(kind):
    """The WIT name of an `error-kind`, e.g. `compile-failed`."""
    return kind.name.lower().replace("_", "-")


def describe(error):
    """`KIND: MESSAGE` for a WIT `error` record."""
    return f"{kind_name(error.kind)}: {error.message}"


def entry(main, *args):
    """Calls `main(*args)`; on an uncaught exception prints it and fails the run (status 1)."""
    try:
        main(*args)
    except Err as e:
        if isinstance(e.value, types.Error):
            print(f"error: {describe(e.value)}", file=sys.stderr)
            # Where it was raised (the component has line numbers but no source files),
            # without this function's frame and the generated bindings'.
            for frame in traceback.extract_tb(e.__traceback__)[1:]:
                if "/wit_world/" not in frame.filename:
                    print(f"  at {frame.filename}:{frame.lineno} in {frame.name}", file=sys.stderr)
        raise Err(None) from None
    except SystemExit as e:
        if e.code not in (None, 0):
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            raise Err(None) from None
    except BaseException:
        traceback.print_exc()
        raise Err(None) from None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
