"""Writes a model repository of PyTorch models exported with `tpubox.torch.export` into DIR, and
PyTorch's own outputs for fixed inputs (DIR/reference.npz), for tests/serve/test_torch_export.py:

    repo/torch_mlp/    an MLP (6 -> 16 -> GELU -> LayerNorm -> 3), batch sizes 1, 2 and 4:
                       input_0 FP32[6] -> output_0 FP32[3]
    repo/torch_bert/   a randomly initialised tiny BERT encoder (hidden 64, 2 layers, from a
                       config: nothing downloaded), batch sizes 1 and 2: ids INT64[16],
                       mask INT64[16] -> hidden FP32[16,64], pooled FP32[64]

Run with the venv that has torch, transformers and torch-mlir ($CACHE/venv-torch) and
PYTHONPATH=python (this checkout's tpubox.torch): python make_torch_models.py DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tpubox.torch as tt


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.norm(F.gelu(self.fc1(x))))


class Bert(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=64)  # fmt: skip
        self.bert = BertModel(cfg, add_pooling_layer=True).eval()

    def forward(self, ids, mask):
        out = self.bert(input_ids=ids, attention_mask=mask)
        return out.last_hidden_state, out.pooler_output


def main(out: Path) -> None:
    torch.manual_seed(0)
    repo = out / "repo"
    ref: dict[str, np.ndarray] = {}
    mlp = MLP().eval()
    tt.export(mlp, [torch.randn(1, 6)], repo, "torch_mlp", batch_sizes=[1, 2, 4])
    x = torch.randn(3, 6)  # a batch size no program has: the server pads to 4
    with torch.no_grad():
        ref["mlp_x"], ref["mlp_y"] = x.numpy(), mlp(x).numpy()
    bert = Bert().eval()
    ids = torch.randint(1, 500, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    tt.export(bert, [ids[:1], mask[:1]], repo, "torch_bert", batch_sizes=[1, 2],
              input_names=["ids", "mask"], output_names=["hidden", "pooled"])  # fmt: skip
    with torch.no_grad():
        hidden, pooled = bert(ids, mask)
    ref.update(bert_ids=ids.numpy(), bert_mask=mask.numpy(), bert_hidden=hidden.numpy(),
               bert_pooled=pooled.numpy())  # fmt: skip
    np.savez(out / "reference.npz", **ref)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
