"""What wasmtime's wasi-nn ONNX classification example prints for a fixture directory,
computed here with ONNX Runtime: the reference of test_wasmtime_example.py.

    python tests/wasi-nn/reference.py FIXTURE_DIR     # prints the example's three Index lines

It follows the example's src/main.rs
(wasmtime/crates/wasi-nn/examples/classification-component-onnx/src/main.rs) step by step:

- the image: `ImageReader::open(..).decode()`, `resize_exact(224, 224, Triangle)` (a copy when
  the image is already 224x224, as the fixture's is: image's `imageops::resize` returns the
  image unchanged for equal dimensions), `to_rgb8()`; the fixture's grey JPEG is decoded with
  make_fixture.decode_gray_jpeg, exact by construction (flat blocks, DC only), and grey becomes
  R = G = B;
- the tensor: for byte i of the interleaved RGB buffer, channel c = i % 3, the f32 value
  `(u8 as f32 / 255.0 - mean[c]) / std[c]` (f32 arithmetic, mean/std written as f32 literals)
  stored at c * 224 * 224 + i / 3: channel-planar [1, 3, 224, 224];
- the model's output `squeezenet0_flatten0_reshape0` (1000 f32), softmax in f32 (exp of each,
  divided by their sum), sorted by probability, largest first (a stable sort: ties keep index
  order), the first three as (label, probability) with the label from the labels file's lines.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_fixture  # noqa: E402

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def example_rgb(fixture: Path) -> np.ndarray:
    """The example's `to_rgb8()` buffer of images/dog.jpg: uint8 [224, 224, 3]."""
    gray = make_fixture.decode_gray_jpeg((Path(fixture) / make_fixture.IMAGE).read_bytes())
    if gray.shape != (make_fixture.SIZE, make_fixture.SIZE):
        raise ValueError(f"image is {gray.shape}: the reference handles 224x224 only (no resize)")
    return np.repeat(gray[:, :, None], 3, axis=2)


def example_tensor(fixture: Path) -> np.ndarray:
    """The example's input tensor, f32 [1, 3, 224, 224], as image_to_tensor builds it."""
    raw = example_rgb(fixture).reshape(-1)  # interleaved RGB, row-major: byte i
    c = np.arange(raw.size) % 3
    norm = (raw.astype(np.float32) / np.float32(255.0) - MEAN[c]) / STD[c]
    assert norm.dtype == np.float32
    planar = np.empty(raw.size, dtype=np.float32)
    planar[c * (raw.size // 3) + np.arange(raw.size) // 3] = norm
    return planar.reshape(1, 3, make_fixture.SIZE, make_fixture.SIZE)


def example_logits(fixture: Path) -> np.ndarray:
    """The model's 1000 outputs for the example's tensor, by ONNX Runtime (CPU)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(
        str(Path(fixture) / make_fixture.MODEL), opts, providers=["CPUExecutionProvider"]
    )
    (out,) = sess.run([make_fixture.OUTPUT], {make_fixture.INPUT: example_tensor(fixture)})
    out = np.asarray(out, dtype=np.float32).reshape(-1)
    if out.size != make_fixture.CLASSES:
        raise ValueError(f"{out.size} outputs, the example wants {make_fixture.CLASSES}")
    return out


def example_probabilities(fixture: Path) -> np.ndarray:
    e = np.exp(example_logits(fixture))
    return e / e.sum(dtype=np.float32)


def labels(fixture: Path) -> list[str]:
    """The labels as the example reads them: BufRead::lines (split at \\n, one \\r dropped)."""
    text = (Path(fixture) / make_fixture.LABELS).read_bytes().decode()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def reference_top3(fixture: Path) -> list[tuple[str, float]]:
    """The example's three (label, probability) lines for FIXTURE, best first."""
    p = example_probabilities(fixture)
    order = sorted(range(p.size), key=lambda i: -p[i])  # stable, as Rust's sort_by
    names = labels(fixture)
    return [(names[i], float(p[i])) for i in order[:3]]


def reference_margins(fixture: Path) -> list[float]:
    """Gaps between the probabilities ranked 1-2, 2-3 and 3-4: how far each of the top three
    stands from its neighbour (the test's ordering is meaningful only if these exceed its
    tolerance)."""
    p = np.sort(example_probabilities(fixture))[::-1]
    return [float(p[k] - p[k + 1]) for k in range(3)]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    fixture = Path(argv[0])
    for label, prob in reference_top3(fixture):
        print(f"Index: {label} - Probability: {np.float32(prob)!s}")
    print("margins (1-2, 2-3, 3-4):", " ".join(f"{m:.6f}" for m in reference_margins(fixture)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
