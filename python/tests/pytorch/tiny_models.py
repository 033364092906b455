"""Tiny models the PyTorch tests share (dist_worker.py and its reference,
test_device_compile.py), and the step count of the distributed ones."""

from __future__ import annotations

import torch
from torch import nn

STEPS = 20


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def tiny_bert() -> nn.Module:
    """A tiny Hugging Face BERT classifier (random weights, dropout off), seeded."""
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).train()


def bert_batches(world: int):
    """STEPS batches of 4 x WORLD sequences of 12 tokens, and their labels."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 100, (STEPS, 4 * world, 12), generator=gen)
    labels = torch.randint(0, 3, (STEPS, 4 * world), generator=gen)
    return ids, labels
