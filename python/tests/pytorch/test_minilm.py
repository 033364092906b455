"""The real all-MiniLM-L6-v2 (the weights `tpubox setup minilm` installs) through
`torch.compile(backend="tpubox")`: Hugging Face's `BertModel`, mean pooling over the attention
mask and L2 normalisation (the sentence-transformers pipeline), compared with the reference
embeddings every other MiniLM path of tpubox matches (`minilm_public.json`: the token ids of 8
sentences and their 384-dimensional embeddings, made with sentence-transformers on the CPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from minilm_torch import load, reference_path  # noqa: E402


def test_real_minilm_through_the_backend_matches_the_reference(alice):
    import tpubox.torch as tt

    cases = json.loads(reference_path().read_text())["cases"]
    assert len(cases) == 8
    model = load()
    compiled = torch.compile(model, backend="tpubox", options={"session": alice})
    before = alice.usage().executions
    worst = 0.0
    with torch.no_grad():
        # One sentence alone, as the reference was made (no padding), and all 8 as one padded
        # batch (the mask keeps the padding out of attention and the mean): two programs.
        c = cases[0]
        ids = torch.tensor([c["input_ids"]], dtype=torch.int64)
        got = compiled(ids, torch.ones_like(ids)).numpy()[0]
        want = np.asarray(c["embedding"], np.float32)
        worst = max(worst, float(np.abs(got - want).max()))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=c["text"])
        n = max(len(c["input_ids"]) for c in cases)
        ids = torch.zeros(len(cases), n, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, c in enumerate(cases):
            ids[i, : len(c["input_ids"])] = torch.tensor(c["input_ids"])
            mask[i, : len(c["input_ids"])] = 1
        got = compiled(ids, mask).numpy()
        want = np.asarray([c["embedding"] for c in cases], np.float32)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        worst = max(worst, float(np.abs(got - want).max()))
    # Every call ran on the daemon (one execution each: no graph break, no CPU fallback).
    assert alice.usage().executions - before == 2
    assert tt.stats()["executions"] == 2 and tt.stats()["compiles"] == 2, tt.stats()
    print(f"all-MiniLM-L6-v2 through the backend: max abs difference {worst:.2e} (1 sentence, a batch of 8)")
