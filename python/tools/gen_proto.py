"""Generates the tpubox package's protobuf and gRPC code from the session API's proto.

    python python/tools/gen_proto.py OUT_DIR

writes OUT_DIR/session_pb2.py, session_pb2.pyi and session_pb2_grpc.py from
host/proto/tpubox/v1/session.proto, with the grpcio-tools of the running interpreter (pinned in
scripts/venvs/python.txt; `bash scripts/dev.sh python-proto` runs this into
python/tpubox/_proto). The proto is mapped to the virtual path `tpubox/_proto/session.proto`, so
that the generated `session_pb2_grpc.py` imports `tpubox._proto.session_pb2` (the package's own
module) and nothing needs rewriting afterwards. python/tests/test_proto.py runs this into a
temporary directory and checks that the committed files are identical.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "host" / "proto" / "tpubox" / "v1"
PROTO = "session.proto"
VIRTUAL_DIR = "tpubox/_proto"
FILES = ("session_pb2.py", "session_pb2.pyi", "session_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Writes FILES into OUT_DIR (created if missing); returns their paths."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{VIRTUAL_DIR}={PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"{VIRTUAL_DIR}/{PROTO}",
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed (exit {rc}): {' '.join(args)}")
        written = []
        for name in FILES:
            src = Path(tmp) / VIRTUAL_DIR / name
            dst = out_dir / name
            shutil.copyfile(src, dst)
            written.append(dst)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    for p in generate(Path(sys.argv[1])):
        print(p)
