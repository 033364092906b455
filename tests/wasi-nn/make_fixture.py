"""Writes a stand-in of the `fixture/` directory of wasmtime's wasi-nn ONNX classification
example (wasmtime/crates/wasi-nn/examples/classification-component-onnx, vendored unchanged),
made offline and small, so that the example's component runs under `tpubox run` without the
5 MB SqueezeNet model or the dog picture:

    python tests/wasi-nn/make_fixture.py DIR      # writes DIR/models, DIR/labels, DIR/images

- ``models/squeezenet1.1-7.onnx``: a small image classifier with random, seeded weights
  (opset 13; Conv with stride 2, Relu, MaxPool, AveragePool, GlobalAveragePool, Flatten,
  Gemm; about 160 KB), with the example's input ``data`` f32 [1,3,224,224] and output
  ``squeezenet0_flatten0_reshape0`` f32 [1,1000].
- ``labels/squeezenet1.1-7.txt``: 1000 synthetic labels, one a line, in SqueezeNet's label
  file's style (``n90000042 synthetic class 42, label 42``).
- ``images/dog.jpg``: a 224x224 grey baseline JPEG made of flat 8x8 blocks, each of one random
  grey level, written by `encode_gray_jpeg` below (one component, every quantization step 1).
  Each block's only coefficient is its DC, 8 * (level - 128), so that every decoder gives back
  exactly the intended levels (an 8x8 DCT of a flat block has no AC terms; no chroma, so no
  colour conversion or subsampling either); the example's decoder (the `image` crate, zune-jpeg)
  turns the grey image into RGB with R = G = B.

Everything is a pure function of SEED: the same bytes on every machine. Needs numpy and onnx
(``$CACHE/venv-onnx-export``); no Pillow. `decode_gray_jpeg` reads such a file back (the
reference, tests/wasi-nn/reference.py, decodes the image with it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SEED = 52
SIZE = 224
CLASSES = 1000
INPUT = "data"
OUTPUT = "squeezenet0_flatten0_reshape0"
MODEL = "models/squeezenet1.1-7.onnx"
LABELS = "labels/squeezenet1.1-7.txt"
IMAGE = "images/dog.jpg"


# ---------------------------------------------------------------------------------------------
# The image: flat 8x8 grey blocks, as a baseline JPEG.

# JPEG's standard luminance DC Huffman table (ITU T.81, Annex K.3): code lengths 1..16, symbols.
DC_BITS = [0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
DC_VALS = list(range(12))
# An AC table for blocks without AC terms: EOB (0x00) is "0"; 0x01 ("10") is there only so that
# no code is all ones (T.81, C.2), and is never written.
AC_BITS = [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
AC_VALS = [0x00, 0x01]


def image_levels(seed: int = SEED) -> np.ndarray:
    """The intended grey levels, uint8 [224, 224]: one random level per 8x8 block."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(SIZE // 8, SIZE // 8), dtype=np.uint8)
    return np.kron(blocks, np.ones((8, 8), dtype=np.uint8))


def _huffman_codes(bits: list[int], vals: list[int]) -> dict[int, tuple[int, int]]:
    """symbol -> (code, length), canonical codes as T.81 Annex C assigns them."""
    codes, code, k = {}, 0, 0
    for length in range(1, 17):
        for _ in range(bits[length - 1]):
            codes[vals[k]] = (code, length)
            code += 1
            k += 1
        code <<= 1
    return codes


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload


def encode_gray_jpeg(levels: np.ndarray) -> bytes:
    """A baseline (SOF0) one-component JPEG of LEVELS (uint8 [H, W], H and W multiples of 8,
    every 8x8 block flat), quantization steps all 1: each block coded as its DC alone."""
    h, w = levels.shape
    if h % 8 or w % 8:
        raise ValueError(f"{w}x{h}: sides must be multiples of 8")
    blocks = levels.reshape(h // 8, 8, w // 8, 8).transpose(0, 2, 1, 3).reshape(-1, 64)
    if not (blocks == blocks[:, :1]).all():
        raise ValueError("every 8x8 block must be of one level")
    dc_codes = _huffman_codes(DC_BITS, DC_VALS)
    eob_code, eob_len = _huffman_codes(AC_BITS, AC_VALS)[0x00]

    acc, nbits, out = 0, 0, bytearray()

    def put(value: int, n: int):
        nonlocal acc, nbits
        acc = (acc << n) | value
        nbits += n
        while nbits >= 8:
            nbits -= 8
            byte = (acc >> nbits) & 0xFF
            out.append(byte)
            if byte == 0xFF:
                out.append(0x00)  # byte stuffing
        acc &= (1 << nbits) - 1

    prev = 0
    for level in blocks[:, 0].astype(np.int64):
        dc = 8 * (int(level) - 128)  # the DCT's DC of a flat block, quantized with step 1
        diff, prev = dc - prev, dc
        size = abs(diff).bit_length()
        code, length = dc_codes[size]
        put(code, length)
        if size:
            put(diff if diff >= 0 else diff + (1 << size) - 1, size)
        put(eob_code, eob_len)
    if nbits:
        put((1 << (8 - nbits)) - 1, 8 - nbits)  # pad with ones

    jfif = b"JFIF\x00" + bytes([1, 1, 0, 0, 1, 0, 1, 0, 0])
    dqt = bytes([0x00]) + bytes([1] * 64)
    sof = bytes([8]) + h.to_bytes(2, "big") + w.to_bytes(2, "big") + bytes([1, 1, 0x11, 0])
    dht = (bytes([0x00]) + bytes(DC_BITS) + bytes(DC_VALS)
           + bytes([0x10]) + bytes(AC_BITS) + bytes(AC_VALS))  # fmt: skip
    sos = bytes([1, 1, 0x00, 0, 63, 0])
    return (b"\xff\xd8" + _segment(0xE0, jfif) + _segment(0xDB, dqt) + _segment(0xC0, sof)
            + _segment(0xC4, dht) + _segment(0xDA, sos) + bytes(out) + b"\xff\xd9")  # fmt: skip


def decode_gray_jpeg(data: bytes) -> np.ndarray:
    """Decodes a baseline one-component JPEG whose blocks have no AC terms (what
    `encode_gray_jpeg` writes) into uint8 [H, W]; ValueError for anything else (other markers
    of interest, AC terms, a DC that an IDCT would not divide exactly)."""
    if data[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG (no SOI)")
    pos, qt, tables, dims = 2, {}, {}, None
    while True:
        if data[pos] != 0xFF:
            raise ValueError(f"marker expected at byte {pos}")
        marker = data[pos + 1]
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        seg = data[pos + 4 : pos + 2 + length]
        pos += 2 + length
        if marker == 0xDB:
            i = 0
            while i < len(seg):
                if seg[i] >> 4:
                    raise ValueError("16-bit quantization tables are not handled")
                qt[seg[i] & 15] = list(seg[i + 1 : i + 65])
                i += 65
        elif marker == 0xC4:
            i = 0
            while i < len(seg):
                tc_th, bits = seg[i], list(seg[i + 1 : i + 17])
                vals = list(seg[i + 17 : i + 17 + sum(bits)])
                codes = _huffman_codes(bits, vals)
                tables[tc_th] = {(length, code): sym for sym, (code, length) in codes.items()}
                i += 17 + sum(bits)
        elif marker == 0xC0:
            if seg[5] != 1 or seg[7] != 0x11:
                raise ValueError("only one component, sampling 1x1, is handled")
            dims = (int.from_bytes(seg[1:3], "big"), int.from_bytes(seg[3:5], "big"), seg[8])
        elif marker == 0xDA:
            if seg[0] != 1:
                raise ValueError("one component per scan expected")
            dc_table, ac_table = tables[seg[2] >> 4], tables[0x10 | (seg[2] & 15)]
            break
        elif marker in (0xDD,) or 0xC1 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            raise ValueError(f"marker 0xFF{marker:02X} is not handled (baseline only)")
    if dims is None:
        raise ValueError("no SOF0")
    h, w, tq = dims
    q0 = qt[tq][0]

    # Entropy-coded data up to EOI, stuffing removed.
    scan = bytearray()
    while True:
        b = data[pos]
        if b == 0xFF:
            nxt = data[pos + 1]
            if nxt == 0x00:
                scan.append(0xFF)
                pos += 2
                continue
            if nxt == 0xD9:
                break
            raise ValueError(f"marker 0xFF{nxt:02X} inside the scan is not handled")
        scan.append(b)
        pos += 1
    bitpos = 0

    def bit() -> int:
        nonlocal bitpos
        v = (scan[bitpos >> 3] >> (7 - (bitpos & 7))) & 1
        bitpos += 1
        return v

    def symbol(table) -> int:
        code = 0
        for length in range(1, 17):
            code = (code << 1) | bit()
            if (length, code) in table:
                return table[(length, code)]
        raise ValueError("bad Huffman code")

    def receive(size: int) -> int:
        v = 0
        for _ in range(size):
            v = (v << 1) | bit()
        return v if size == 0 or v >> (size - 1) else v - (1 << size) + 1

    out = np.empty((h // 8, w // 8), dtype=np.int64)
    dc = 0
    for k in range(out.size):
        dc += receive(symbol(dc_table))
        if symbol(ac_table) != 0x00:
            raise ValueError(f"block {k} has AC terms: not a flat-block JPEG")
        value = dc * q0
        if value % 8:
            raise ValueError(f"block {k}: DC {value} is not a multiple of 8 (inexact IDCT)")
        out.flat[k] = value // 8 + 128
    if (out < 0).any() or (out > 255).any():
        raise ValueError("levels out of range")
    return np.kron(out.astype(np.uint8), np.ones((8, 8), dtype=np.uint8))


# ---------------------------------------------------------------------------------------------
# The model.


def make_model(seed: int = SEED):
    """The classifier, an onnx.ModelProto: [1,3,224,224] -> [1,1000] logits.

    data -> Conv(3->8, 3x3, stride 2, pad 1) -> Relu -> MaxPool(2, stride 2)
         -> Conv(8->16, 3x3, stride 2, pad 1) -> Relu -> AveragePool(2, stride 2)
         -> Conv(16->32, 3x3, stride 2, pad 1) -> Relu -> GlobalAveragePool -> Flatten
         -> Gemm(32 -> 1000, transB) = squeezenet0_flatten0_reshape0
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed + 1)

    def he(shape, fan_in):
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    inits = [
        numpy_helper.from_array(he((8, 3, 3, 3), 27), "conv1_w"),
        numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "conv1_b"),
        numpy_helper.from_array(he((16, 8, 3, 3), 72), "conv2_w"),
        numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "conv2_b"),
        numpy_helper.from_array(he((32, 16, 3, 3), 144), "conv3_w"),
        numpy_helper.from_array((rng.standard_normal(32) * 0.1).astype(np.float32), "conv3_b"),
        # Logits spread over a few units, so that softmax has a clear top 3.
        numpy_helper.from_array(he((CLASSES, 32), 32) * np.float32(2.0), "fc_w"),
        numpy_helper.from_array((rng.standard_normal(CLASSES) * 0.5).astype(np.float32), "fc_b"),
    ]
    conv = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    pool = dict(kernel_shape=[2, 2], strides=[2, 2])
    nodes = [
        helper.make_node("Conv", [INPUT, "conv1_w", "conv1_b"], ["c1"], "conv1", **conv),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], "pool1", **pool),
        helper.make_node("Conv", ["p1", "conv2_w", "conv2_b"], ["c2"], "conv2", **conv),
        helper.make_node("Relu", ["c2"], ["r2"], "relu2"),
        helper.make_node("AveragePool", ["r2"], ["p2"], "pool2", **pool),
        helper.make_node("Conv", ["p2", "conv3_w", "conv3_b"], ["c3"], "conv3", **conv),
        helper.make_node("Relu", ["c3"], ["r3"], "relu3"),
        helper.make_node("GlobalAveragePool", ["r3"], ["g"], "gap"),
        helper.make_node("Flatten", ["g"], ["f"], "flatten", axis=1),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], [OUTPUT], "fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tpubox_wasi_nn_fixture",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [1, CLASSES])],
        inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 13)],
        ir_version=8,
        producer_name="tpubox tests/wasi-nn/make_fixture.py",
        producer_version="1",
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def labels() -> list[str]:
    return [f"n{90000000 + i:08d} synthetic class {i}, label {i}" for i in range(CLASSES)]


def write_fixture(out: Path, seed: int = SEED) -> Path:
    """Writes the fixture into OUT (created if missing) and returns OUT."""
    out = Path(out)
    for sub in ("models", "labels", "images"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    (out / MODEL).write_bytes(make_model(seed).SerializeToString())
    (out / LABELS).write_text("".join(line + "\n" for line in labels()))
    levels = image_levels(seed)
    jpeg = encode_gray_jpeg(levels)
    if not np.array_equal(decode_gray_jpeg(jpeg), levels):
        raise AssertionError("the JPEG does not decode to the intended levels")
    (out / IMAGE).write_bytes(jpeg)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the fixture directory to write")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    out = write_fixture(args.out, args.seed)
    for rel in (MODEL, LABELS, IMAGE):
        print(f"{out / rel}: {(out / rel).stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
