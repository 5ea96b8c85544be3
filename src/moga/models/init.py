"""A width-aware initialization by role: the spectral condition, read in the role plan's geometry.

Each matrix ``W`` (``m = fan_out`` x ``n = fan_in`` in its plan layout, per expert for stacks) is drawn
``N(0, sigma^2)`` with ``sigma = min(1, sqrt(m/n)) / sqrt(n)``. Its spectral norm is then about
``sqrt(m/n)``, so its ``(2,mean)->(2,mean)`` norm (docs/math.md §1.2) is about 1 at every width: features
of RMS 1 go in, features of RMS O(1) come out, whatever the width (Yang, Simon and Bernstein's spectral
condition for feature learning, 2023). By role:

- ``hidden`` (``m ~ n``) and ``conv``: ``1/sqrt(fan_in)``, RMS-preserving;
- ``input`` (``n`` the data dimension, fixed): ``1/sqrt(fan_in)``, the same at every width;
- ``readout`` (``m`` the classes, fixed): ``sqrt(m)/n``, muP's readout. Its output at init shrinks like
  ``1/sqrt(width)`` and its own update sets the logits' scale; a ``1/sqrt(n)`` readout would instead
  move the logits ``sqrt(width)`` times faster through the change of its input;
- ``embedding`` (one-hot inputs): ``1``, each token's vector of RMS 1 (the ``1->(q,mean)`` unit column);
- ``tied`` and ``vector`` tensors keep the model's own init (a tied table is also a head; no one
  scale serves both uses).

The papers' optimizers need no particular init; this one removes the init's width dependence so that
``moga coordcheck`` can tell it from the optimizer's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moga.roles import RolePlan, build_plan

SCALED_ROLES = ("input", "hidden", "readout", "conv", "embedding")


def width_aware_std(role: str, fan_out: int, fan_in: int) -> float:
    """The init's standard deviation for a matrix of ``role`` and plan shape ``fan_out x fan_in``."""
    if role == "embedding":
        return 1.0
    return min(1.0, math.sqrt(fan_out / fan_in)) / math.sqrt(fan_in)


@torch.no_grad()
def width_aware_init(model: nn.Module, plan: RolePlan | None = None, seed: int | None = None) -> dict[str, float]:
    """Redraw every matrix of ``model`` by :func:`width_aware_std` (``plan`` from ``build_plan(model)`` when
    not given); returns ``{parameter: std}`` for the tensors it redrew. ``seed`` makes the draw repeatable."""
    plan = plan if plan is not None else build_plan(model)
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    drawn = {}
    for e in plan:
        if e.role not in SCALED_ROLES or e.matrix_shape is None:
            continue
        std = width_aware_std(e.role, *e.matrix_shape)
        e.param.copy_(torch.randn(e.param.shape, generator=g, dtype=torch.float32).mul_(std))
        drawn[e.name] = std
    return drawn
