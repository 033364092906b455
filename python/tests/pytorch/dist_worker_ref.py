"""The reference of test_distributed.py's DDP run: dist_worker.py's training in one process on
the whole batch, on the CPU with PyTorch alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tiny_models as m


def one_process(world: int) -> list[list[float]]:
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(m.STEPS, 8 * world, 16, generator=gen)
    ys = torch.randint(0, 4, (m.STEPS, 8 * world), generator=gen)
    model = m.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(m.STEPS):
        loss = F.cross_entropy(model(xs[i]), ys[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def one_process_bert(world: int) -> list[list[float]]:
    ids, labels = m.bert_batches(world)
    model = m.tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(m.STEPS):
        loss = model(input_ids=ids[i], labels=labels[i]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]
