"""all-MiniLM-L6-v2 as a PyTorch module, for python/tests/pytorch/test_minilm.py and
python/bench/bench_minilm_torch.py: where its files and the reference embeddings are, and the
sentence-transformers pipeline around Hugging Face's ``BertModel``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpubox_daemon import REPO, binary  # noqa: E402


def reference_path() -> Path:
    """$TPUBOX_MINILM_REFERENCE, else `shared/` beside the checkout, else /work/shared (the
    search tests/all/minilm.rs and tests/serve make)."""
    env = os.environ.get("TPUBOX_MINILM_REFERENCE")
    if env:
        return Path(env)
    beside = REPO.parent / "shared" / "reference" / "minilm_public.json"
    return beside if beside.is_file() else Path("/work/shared/reference/minilm_public.json")


def minilm_dir() -> Path:
    """$TPUBOX_MINILM_DIR, else the directory `tpubox setup minilm` prints.

    Raises:
        RuntimeError: `tpubox setup minilm` printed no directory.
    """
    env = os.environ.get("TPUBOX_MINILM_DIR")
    if env:
        return Path(env)
    out = subprocess.run([str(binary()), "setup", "minilm"], capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("minilm: "):
            return Path(line.removeprefix("minilm: ").strip())
    raise RuntimeError(f"`tpubox setup minilm` printed no directory:\n{out.stdout}\n{out.stderr}")


class SentenceEmbedding(torch.nn.Module):
    """BertModel -> mean over the attention mask -> L2 normalise (all-MiniLM-L6-v2's
    modules.json: Transformer, Pooling with mean tokens, Normalize).

    ``forward(input_ids, attention_mask)``: int64 ``[batch, tokens]`` each (mask 1 for a token,
    0 for padding) -> float32 ``[batch, hidden]`` unit vectors (hidden 384 for MiniLM).
    """

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)


def load() -> SentenceEmbedding:
    """The real all-MiniLM-L6-v2 (`tpubox setup minilm`'s files) in eval mode, eager attention
    (the plain matmul-softmax form the backend lowers)."""
    from transformers import BertModel

    return SentenceEmbedding(BertModel.from_pretrained(str(minilm_dir()), attn_implementation="eager")).eval()
