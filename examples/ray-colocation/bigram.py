"""The colocation example's policy: a bigram language model over 32 symbols, trained by SGD.

Plain NumPy and StableHLO text, no Ray and no JAX: ``colocate.py`` (the Ray actors),
``tests/ray/test_colocation.py`` and ``python/bench/bench_colocation.py`` share it.

The model is one matrix ``W`` [V, V] (f32): the logits of the token after ``t`` are ``W[t]``.
A training step is one full-batch SGD step of the mean cross-entropy over the corpus's pairs
``(x, y)`` of consecutive symbols, given as one-hot rows ``X``, ``Y`` [B, V]:

    P  = softmax(X @ W)              (row-wise, max-subtracted)
    W' = W - (lr / B) * X^T (P - Y)

:func:`train_step_program` writes that step as StableHLO text for given sizes (``@main(W, X, Y)
-> W'``), :func:`logits_program` the sampler's ``onehot(t) @ W`` ([1, V] -> [1, V]), and
:func:`reference_step` / :func:`reference_weights` / :func:`greedy` replay both in NumPy f32.
"""

from __future__ import annotations

import numpy as np

SYMBOLS = " abcdefghijklmnopqrstuvwxyz.,'!?"
"""The vocabulary: 32 printable symbols; token i is ``SYMBOLS[i]``."""

VOCAB = len(SYMBOLS)

CORPUS = (
    "the cat sat on the mat. the dog sat on the log! a bird sang in the tree, and the cat "
    "watched it. is it not a fine day? the sun is warm, the grass is green, and the little "
    "dog runs after the ball. 'come back!' said the girl, but the dog ran on and on."
)
"""The fixed training text (every character is one of :data:`SYMBOLS`)."""

LR = 4.0
"""The learning rate of the example's SGD steps."""

SEED = 0
"""Seed of the initial weights (``0.1 * standard normal``)."""

START = SYMBOLS.index("t")
"""The sampler's first token."""


def encode(text: str) -> np.ndarray:
    return np.array([SYMBOLS.index(c) for c in text], np.int32)


def decode(tokens) -> str:
    return "".join(SYMBOLS[int(t)] for t in tokens)


def one_hot(tokens, vocab: int = VOCAB) -> np.ndarray:
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    out = np.zeros((tokens.size, vocab), np.float32)
    out[np.arange(tokens.size), tokens] = 1.0
    return out


def batch(vocab: int = VOCAB, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The training batch: one-hot ``X``, ``Y`` [B, VOCAB] of the corpus's consecutive pairs
    (B = len(CORPUS) - 1), or of SIZE pairs (the corpus's pairs repeated, for benchmarks).
    VOCAB may exceed 32 (the extra symbols never occur)."""
    t = encode(CORPUS)
    x, y = t[:-1], t[1:]
    if size is not None:
        reps = -(-size // x.size)
        x, y = np.tile(x, reps)[:size], np.tile(y, reps)[:size]
    return one_hot(x, vocab), one_hot(y, vocab)


def initial_weights(vocab: int = VOCAB, seed: int = SEED) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal((vocab, vocab))).astype(np.float32)


def _f32(c: float) -> str:
    # An MLIR float literal (it needs the decimal point) that rounds to the same f32.
    return f"{float(np.float32(c)):.9e}"


def train_step_program(vocab: int, batch_size: int, lr: float = LR) -> str:
    """StableHLO text of one SGD step: ``@main(W: [V,V], X: [B,V], Y: [B,V]) -> W'``."""
    v, b = vocab, batch_size
    w, bv, rows = f"tensor<{v}x{v}xf32>", f"tensor<{b}x{v}xf32>", f"tensor<{b}xf32>"
    hi = "precision = [HIGHEST, HIGHEST]"
    return f"""
func.func @main(%w: {w}, %x: {bv}, %y: {bv}) -> {w} {{
  %logits = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], {hi} : ({bv}, {w}) -> {bv}
  %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32>
  %m = stablehlo.reduce(%logits init: %ninf) applies stablehlo.maximum across dimensions = [1] : ({bv}, tensor<f32>) -> {rows}
  %mb = stablehlo.broadcast_in_dim %m, dims = [0] : ({rows}) -> {bv}
  %z = stablehlo.subtract %logits, %mb : {bv}
  %e = stablehlo.exponential %z : {bv}
  %zero = stablehlo.constant dense<0.000000000e+00> : tensor<f32>
  %s = stablehlo.reduce(%e init: %zero) applies stablehlo.add across dimensions = [1] : ({bv}, tensor<f32>) -> {rows}
  %sb = stablehlo.broadcast_in_dim %s, dims = [0] : ({rows}) -> {bv}
  %p = stablehlo.divide %e, %sb : {bv}
  %d = stablehlo.subtract %p, %y : {bv}
  %g = stablehlo.dot_general %x, %d, contracting_dims = [0] x [0], {hi} : ({bv}, {bv}) -> {w}
  %c = stablehlo.constant dense<{_f32(lr / b)}> : tensor<f32>
  %cb = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> {w}
  %step = stablehlo.multiply %g, %cb : {w}
  %next = stablehlo.subtract %w, %step : {w}
  func.return %next : {w}
}}
"""


def logits_program(vocab: int = VOCAB) -> str:
    """StableHLO text of the sampler's logits: ``@main(onehot: [1,V], W: [V,V]) -> [1,V]``
    (the row of W of the current token)."""
    v = vocab
    w, row = f"tensor<{v}x{v}xf32>", f"tensor<1x{v}xf32>"
    return f"""
func.func @main(%t: {row}, %w: {w}) -> {row} {{
  %l = stablehlo.dot_general %t, %w, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : ({row}, {w}) -> {row}
  func.return %l : {row}
}}
"""


def reference_step(w: np.ndarray, x: np.ndarray, y: np.ndarray, lr: float = LR) -> np.ndarray:
    """NumPy f32 of :func:`train_step_program`."""
    logits = x @ w
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    g = x.T @ (p - y)
    return (w - np.float32(lr / x.shape[0]) * g).astype(np.float32)


def reference_weights(steps: int, vocab: int = VOCAB, lr: float = LR) -> np.ndarray:
    """W after STEPS training steps from :func:`initial_weights`, in NumPy."""
    x, y = batch(vocab)
    w = initial_weights(vocab)
    for _ in range(steps):
        w = reference_step(w, x, y, lr)
    return w


def loss(w: np.ndarray, vocab: int = VOCAB) -> float:
    """Mean cross-entropy of W on the corpus."""
    x, y = batch(vocab)
    logits = (x @ w).astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-(logp * y).sum(axis=1).mean())


def greedy(w: np.ndarray, n: int, start: int = START) -> list[int]:
    """N tokens greedily decoded from W after START (argmax of each row, first on ties)."""
    out, t = [], start
    for _ in range(n):
        t = int(np.argmax(w[t]))
        out.append(t)
    return out
