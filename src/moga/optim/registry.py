"""Every optimizer a config or a command can name, in one table.

The training config's ``optim.name`` choices, the keys each optimizer reads, the optimizers the depth
paper's step rule applies to, and the builder all come from :data:`OPTIMIZERS`; adding an optimizer is
one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moga.optim.adamw_scaled import ScaledAdamW
from moga.optim.adaptive import AdaptiveGD
from moga.optim.base import warn_if_decay_diverges
from moga.optim.moga import MOGA
from moga.optim.muon import Muon

_GEOMETRY_KEYS = frozenset({"betas", "eps", "overrides", "nonfinite", "lr_multipliers", "geometries"})


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's split: matrices decay, vectors (biases, norm gains) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    build: Callable[..., torch.optim.Optimizer]  # (model, weight_decay=..., **keys) -> optimizer
    keys: frozenset[str]  # the optional config keys it reads; setting another is an error
    default_lr: float | None = None  # None: the class default
    unit_steps: bool = False  # steps are lr x a unit step in a norm (the geometry optimizers)
    description: str = ""


def _geometry(cls):
    def build(model, weight_decay=0.0, **kw):
        return cls(model, weight_decay=weight_decay, **kw)
    return build


def _torch(cls):
    def build(model, weight_decay=0.0, **kw):
        optimizer = cls(decay_groups(model, weight_decay), **kw)
        warn_if_decay_diverges(optimizer.param_groups)  # torch's own optimizers do not
        return optimizer
    return build


def _moga(model, weight_decay=0.0, matrices=None, **kw):
    """MOGA; ``matrices`` (e.g. 'col(q=2)', column normalization) replaces row(p) on every matrix but the readout."""
    if matrices is not None:  # the config's own geometries (e.g. a readout's) still win
        kw["geometries"] = {**{role: matrices for role in ("input", "hidden", "conv")}, **(kw.get("geometries") or {})}
    return MOGA(model, weight_decay=weight_decay, **kw)


def _adaptive(model, weight_decay=0.0, lr=1.0, layers=None, nonfinite=None):
    return AdaptiveGD(model.parameters(), alpha=lr, layers=layers, nonfinite=nonfinite or "skip")


OPTIMIZERS: dict[str, OptimizerEntry] = {e.name: e for e in (
    OptimizerEntry("moga", _moga, _GEOMETRY_KEYS | {"momentum", "nesterov", "p", "embedding_q", "vectors",
                                                    "matrices"},
                   unit_steps=True, description="MOGA: row(p) on matrices"),
    OptimizerEntry("muon", _geometry(Muon), _GEOMETRY_KEYS | {"momentum", "nesterov", "embedding_q", "vectors",
                                                              "scale", "ns_steps", "ns_dtype"},
                   unit_steps=True, description="Muon: the spectral geometry on matrices"),
    OptimizerEntry("adamw", _torch(torch.optim.AdamW), frozenset({"betas", "eps", "fused"}), default_lr=1e-3,
                   description="torch.optim.AdamW, no width factors"),
    OptimizerEntry("adamw-scaled", _geometry(ScaledAdamW), _GEOMETRY_KEYS, unit_steps=True,
                   description="rescaled AdamW: lr/fan_in on matrices"),
    OptimizerEntry("sgd", _torch(torch.optim.SGD), frozenset({"momentum", "nesterov", "fused"}), default_lr=1e-2,
                   description="torch.optim.SGD"),
    OptimizerEntry("adaptive-gd", _adaptive, frozenset({"layers", "nonfinite"}), default_lr=1.0,
                   description="the convergence paper's adaptive gradient descent"),
)}
OPTIMIZER_NAMES = tuple(OPTIMIZERS)
UNIT_STEP_OPTIMIZERS = tuple(n for n, e in OPTIMIZERS.items() if e.unit_steps)
