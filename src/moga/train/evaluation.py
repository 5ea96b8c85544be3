"""A split's mean loss and accuracy, its batches shared out over the run's processes."""

from __future__ import annotations

import math

import torch
from torch import nn

from . import distributed, parallel


@torch.no_grad()
def evaluate(model: nn.Module, task, cfg, dist: distributed.Dist, split: str, fsdp: bool) -> tuple[float, float | None]:
    """(mean loss, accuracy or None) over a split, the batches shared out over processes."""
    d = dist
    batch_size = cfg.eval.batch_size or min(task.micro_batch, 1000)
    model.eval()
    loss_sum = correct_sum = count_sum = 0.0
    batches = list(task.eval_batches(split, batch_size, cfg.eval.max_batches))
    mine = batches[d.rank::d.world]
    # FSDP gathers weights in every forward, so every rank runs as many: the short ones run a discarded one.
    spare = -(-len(batches) // d.world) - len(mine) if fsdp and batches else 0
    for i, (x, y) in enumerate(mine + batches[:spare]):
        x, y = x.to(d.device), y.to(d.device)
        with parallel.autocast(cfg.train.precision, d.device):
            loss, correct, count = task.loss(model, x, y)
        if i >= len(mine):
            continue
        loss_sum += float(loss) * count
        correct_sum += float(correct)
        count_sum += count
    model.train()
    loss_sum, correct_sum, count_sum = distributed.all_sum(d, [loss_sum, correct_sum, count_sum])
    if count_sum == 0:
        return math.nan, None
    return loss_sum / count_sum, (correct_sum / count_sum if correct_sum >= 0 else None)
