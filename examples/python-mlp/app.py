"""python-mlp: a tpubox guest in Python.

Reads a small CSV table (a header and 1 to 64 rows of three numbers), normalises each column to
zero mean and unit variance in Python, then runs a two-layer perceptron on the host's device:

    y = relu(x · W1 + b1) · W2 + b2      x: f32[N,3], W1: f32[3,8], W2: f32[8,2]

as a StableHLO program (MLIR text) that the guest writes for the row count it read. It reads the
result back, recomputes it in plain Python and fails if the two differ by more than 1e-4.

Input: the CSV text after `--csv`, or stdin when there is no argument.
Output (stdout): `rows: N`, `normalized: [[...]]`, `result: [[y0, y1], ...]` (JSON rows) and
`max abs diff: D`. On any error: one line `python-mlp: error: ...` on stderr, exit status 1.

The weights come from fixed formulas (see `weights()`), so anyone can recompute the numbers.
"""

import math
import struct
import sys

from wit_world import exports
from wit_world.imports import client, types
from componentize_py_types import Err

NAME = "python-mlp"
IN, HIDDEN, OUT = 3, 8, 2
MAX_ROWS = 64
TOLERANCE = 1e-4


class Failure(Exception):
    """An error with a one-line message for stderr."""


def is_number(text):
    """Accepts `[+-]digits[.digits][e[+-]digits]` (a leading or trailing dot is fine), nothing
    else: no `nan`, `inf`, hex or underscores, so every guest language reads the same numbers."""
    i, n = 0, len(text)
    if i < n and text[i] in "+-":
        i += 1
    digits = 0
    while i < n and text[i].isdigit() and text[i].isascii():
        i, digits = i + 1, digits + 1
    if i < n and text[i] == ".":
        i += 1
        while i < n and text[i].isdigit() and text[i].isascii():
            i, digits = i + 1, digits + 1
    if digits == 0:
        return False
    if i < n and text[i] in "eE":
        i += 1
        if i < n and text[i] in "+-":
            i += 1
        exp = 0
        while i < n and text[i].isdigit() and text[i].isascii():
            i, exp = i + 1, exp + 1
        if exp == 0:
            return False
    return i == n


def parse_csv(text):
    """Returns (column names, rows of floats). Blank lines are skipped; fields are trimmed."""
    lines = [(no, line) for no, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise Failure("empty input: expected a header line and at least one row")
    header_no, header = lines[0]
    names = [f.strip() for f in header.split(",")]
    if len(names) != IN:
        raise Failure(f"line {header_no}: header has {len(names)} columns, expected {IN}")
    rows = []
    for no, line in lines[1:]:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != IN:
            raise Failure(f"line {no}: expected {IN} fields, got {len(fields)}")
        row = []
        for col, field in enumerate(fields, 1):
            if not is_number(field):
                raise Failure(f"line {no}, column {col}: not a number: {field!r}")
            value = float(field)
            if not math.isfinite(value):
                raise Failure(f"line {no}, column {col}: out of range: {field!r}")
            row.append(value)
        rows.append(row)
    if not rows:
        raise Failure("no data rows after the header")
    if len(rows) > MAX_ROWS:
        raise Failure(f"{len(rows)} data rows, at most {MAX_ROWS} allowed")
    return names, rows


def normalise(rows):
    """Each column to zero mean and unit (population) variance, in double precision; a constant
    column becomes all zeros."""
    n = len(rows)
    out = [[0.0] * IN for _ in rows]
    for c in range(IN):
        total = 0.0
        for r in rows:
            total += r[c]
        mean = total / n
        sq = 0.0
        for r in rows:
            sq += (r[c] - mean) * (r[c] - mean)
        std = math.sqrt(sq / n)
        for i, r in enumerate(rows):
            out[i][c] = (r[c] - mean) / std if std > 0.0 else 0.0
    return out


def f32(v):
    """`v` rounded to the nearest float32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def weights():
    """Deterministic weights: W1 f32[3,8], b1 f32[8], W2 f32[8,2], b2 f32[2] (row-major)."""
    w1 = [f32(((3 * k + 5 * j) % 11 - 5) / 8) for k in range(IN) for j in range(HIDDEN)]
    b1 = [f32(((j % 3) - 1) / 10) for j in range(HIDDEN)]
    w2 = [f32(((7 * j + 3 * m) % 13 - 6) / 10) for j in range(HIDDEN) for m in range(OUT)]
    b2 = [f32(0.25 - 0.5 * m) for m in range(OUT)]
    return w1, b1, w2, b2


def program(n):
    """The MLP in StableHLO for `n` rows. HIGHEST precision keeps f32 matmuls in full f32 on
    backends that would otherwise use bf16 or TF32 passes."""
    x, h, y = f"tensor<{n}x{IN}xf32>", f"tensor<{n}x{HIDDEN}xf32>", f"tensor<{n}x{OUT}xf32>"
    return f"""
module @python_mlp {{
  func.func public @main(%x: {x}, %w1: tensor<{IN}x{HIDDEN}xf32>, %b1: tensor<{HIDDEN}xf32>,
                         %w2: tensor<{HIDDEN}x{OUT}xf32>, %b2: tensor<{OUT}xf32>) -> {y} {{
    %xw = stablehlo.dot_general %x, %w1, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : ({x}, tensor<{IN}x{HIDDEN}xf32>) -> {h}
    %bb1 = stablehlo.broadcast_in_dim %b1, dims = [1] : (tensor<{HIDDEN}xf32>) -> {h}
    %z = stablehlo.add %xw, %bb1 : {h}
    %zero = stablehlo.constant dense<0.0> : {h}
    %a = stablehlo.maximum %z, %zero : {h}
    %aw = stablehlo.dot_general %a, %w2, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : ({h}, tensor<{HIDDEN}x{OUT}xf32>) -> {y}
    %bb2 = stablehlo.broadcast_in_dim %b2, dims = [1] : (tensor<{OUT}xf32>) -> {y}
    %out = stablehlo.add %aw, %bb2 : {y}
    func.return %out : {y}
  }}
}}
"""


def reference(x, w1, b1, w2, b2):
    """The same MLP in plain Python (double precision)."""
    out = []
    for row in x:
        hidden = []
        for j in range(HIDDEN):
            z = b1[j]
            for k in range(IN):
                z += row[k] * w1[k * HIDDEN + j]
            hidden.append(max(z, 0.0))
        ys = []
        for m in range(OUT):
            y = b2[m]
            for j in range(HIDDEN):
                y += hidden[j] * w2[j * OUT + m]
            ys.append(y)
        out.append(ys)
    return out


def device_call(what, fn, *args):
    """Calls a tpubox import, turning its `error` into a `Failure` that names the step."""
    try:
        return fn(*args)
    except Err as e:
        err = e.value
        raise Failure(f"{what}: {err.kind.name.lower().replace('_', '-')}: {err.message}") from None


def tensor(values, dims):
    data = struct.pack(f"<{len(values)}f", *values)
    return device_call("upload", types.Tensor.from_bytes, types.Dtype.F32, dims, data, None)


def json_rows(rows):
    return "[" + ",".join("[" + ",".join(repr(v) for v in r) + "]" for r in rows) + "]"


def main(argv):
    if len(argv) == 0:
        text = sys.stdin.read()
    elif len(argv) == 2 and argv[0] == "--csv":
        text = argv[1]
    else:
        raise Failure("usage: python-mlp [--csv TEXT]  (without --csv the CSV is read from stdin)")

    _names, rows = parse_csv(text)
    x = [[f32(v) for v in row] for row in normalise(rows)]
    n = len(x)
    w1, b1, w2, b2 = weights()

    exe = device_call(
        "compile", client.compile, client.ProgramFormat.MLIR_TEXT,
        program(n).encode(), client.CompileOptions(device=None))
    # `with` drops each handle (and frees its device memory) as soon as the block ends, instead
    # of whenever Python's garbage collector gets to it.
    with exe, tensor([v for r in x for v in r], [n, IN]) as xt, \
            tensor(w1, [IN, HIDDEN]) as w1t, tensor(b1, [HIDDEN]) as b1t, \
            tensor(w2, [HIDDEN, OUT]) as w2t, tensor(b2, [OUT]) as b2t:
        outs = device_call("execute", client.execute, exe, [xt, w1t, b1t, w2t, b2t], [])
        if len(outs) != 1:
            raise Failure(f"expected 1 result, got {len(outs)}")
        with outs[0] as out:
            spec = out.spec()
            if spec.dtype != types.Dtype.F32 or list(spec.dims) != [n, OUT]:
                raise Failure(f"result has spec {spec}, expected f32[{n},{OUT}]")
            data = device_call("read", out.read)
    flat = struct.unpack(f"<{n * OUT}f", data)
    got = [list(flat[i * OUT:(i + 1) * OUT]) for i in range(n)]

    want = reference(x, w1, b1, w2, b2)
    diff = max(abs(g - w) for gr, wr in zip(got, want) for g, w in zip(gr, wr))
    if not all(math.isfinite(v) for r in got for v in r) or not diff <= TOLERANCE:
        raise Failure(f"device result {json_rows(got)} differs from the Python reference "
                      f"{json_rows(want)} by {diff} (> {TOLERANCE})")
    print(f"rows: {n}")
    print(f"normalized: {json_rows(x)}")
    print(f"result: {json_rows(got)}")
    print(f"max abs diff: {diff!r}")


class Run(exports.Run):
    def run(self) -> None:
        try:
            main(sys.argv[1:])
        except Failure as e:
            print(f"{NAME}: error: {e}", file=sys.stderr)
            raise Err(None)
        except Exception as e:  # a bug in this guest: still one line, still status 1
            print(f"{NAME}: error: internal: {type(e).__name__}: {e}", file=sys.stderr)
            raise Err(None)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
