"""Every optimizer a config or a command can name, in one table.

The training config's ``optim.name`` choices, the keys each optimizer reads, the optimizers the depth
paper's step rule applies to, and the builder all come from :data:`OPTIMIZERS`; adding an optimizer is
one entry here. An entry's keys are read off its builder's signature (and the class's it passes ``**kw``
on to), less the options a training config does not set.
"""

from __future__ import annotations

import inspect
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moga.optim.adamw_scaled import ScaledAdamW
from moga.optim.adaptive import AdaptiveGD
from moga.optim.moga import MOGA
from moga.optim.muon import MUON_PRESETS, Muon
from moga.optim.options import SharedOptions, warn_if_decay_diverges

# Arguments a config does not set as optim keys: the builder's own (model, lr, weight_decay are optim fields of
# their own), options a training run fixes (float32 parameters, the default kernel, one process or FSDP2), and
# the Newton-Schulz internals.
NOT_CONFIG_KEYS = frozenset({"model", "params", "lr", "weight_decay", "geometry", "state_dtype", "master_weights",
                             "distributed", "kernel", "ns_coefficients", "method"})


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's split: matrices decay, vectors (biases, norm gains) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def signature_types(*functions: Callable) -> dict[str, object]:
    """{keyword: its annotation (``typing.Any`` where none resolves)} of what ``functions`` take, with the shared
    options where one passes ``**options`` on to the base class (:class:`~moga.optim.options.SharedOptions`),
    less :data:`NOT_CONFIG_KEYS`."""
    types: dict[str, object] = {}
    for f in functions:
        params = inspect.signature(f).parameters.values()
        scope = vars(sys.modules[f.__module__])
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in NOT_CONFIG_KEYS:
                types.setdefault(p.name, _resolved(p.annotation, scope))
        if isinstance(f, type) and any(p.kind is p.VAR_KEYWORD for p in params):
            shared = typing.get_type_hints(SharedOptions)
            types.update({k: v for k, v in shared.items() if k not in NOT_CONFIG_KEYS and k not in types})
    return types


def _resolved(annotation, scope: dict):
    """A signature's annotation (a string under ``from __future__ import annotations``) as a type."""
    if annotation is inspect.Parameter.empty:
        return typing.Any
    try:
        return eval(annotation, scope) if isinstance(annotation, str) else annotation  # noqa: S307 (our own source)
    except Exception:
        return typing.Any


def signature_keys(*functions: Callable) -> frozenset[str]:
    """The keys of :func:`signature_types`."""
    return frozenset(signature_types(*functions))


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    build: Callable[..., torch.optim.Optimizer]  # (model, weight_decay=..., **keys) -> optimizer
    keys: frozenset[str] | None = None  # the optional config keys it reads (setting another is an error); None:
    # those of build's signature and of the class that its ``**kw`` reach (``build.passes_to``)
    default_lr: float | None = None  # None: the class default
    unit_steps: bool = False  # steps are lr x a unit step in a norm (the geometry optimizers)
    description: str = ""

    def __post_init__(self) -> None:
        if self.keys is None:
            reached = getattr(self.build, "passes_to", None)
            object.__setattr__(self, "keys", signature_keys(self.build, *([reached] if reached else [])))


def _passes_to(cls):
    """Marks a builder whose ``**kw`` go to ``cls``: the entry's keys include ``cls``'s."""
    def mark(build):
        build.passes_to = cls
        return build
    return mark


def _geometry(cls):
    @_passes_to(cls)
    def build(model, weight_decay=0.0, **kw):
        return cls(model, weight_decay=weight_decay, **kw)
    return build


def _torch(cls):
    def build(model, weight_decay=0.0, **kw):
        optimizer = cls(decay_groups(model, weight_decay), **kw)
        warn_if_decay_diverges(optimizer.param_groups)  # torch's own optimizers do not
        return optimizer
    return build


@_passes_to(MOGA)
def _moga(model, weight_decay=0.0, matrices=None, **kw):
    """MOGA; ``matrices`` (e.g. 'col(q=2)', column normalization) replaces row(p) on every matrix but the readout."""
    if matrices is not None:  # the config's own geometries (e.g. a readout's) still win
        kw["geometries"] = {**{role: matrices for role in ("input", "hidden", "conv")}, **(kw.get("geometries") or {})}
    return MOGA(model, weight_decay=weight_decay, **kw)


@_passes_to(Muon)
def _muon(model, weight_decay=0.0, preset=None, **kw):
    """Muon; a config's ``optim.preset`` that is MOGA's (a reproduction pins one for all it sweeps) runs Muon's
    default, the published recipe."""
    return Muon(model, weight_decay=weight_decay, preset=preset if preset in MUON_PRESETS else "published", **kw)


def _adaptive(model, weight_decay=0.0, lr=1.0, layers=None, nonfinite=None):
    return AdaptiveGD(model.parameters(), alpha=lr, layers=layers, nonfinite=nonfinite or "skip")


OPTIMIZERS: dict[str, OptimizerEntry] = {e.name: e for e in (
    OptimizerEntry("moga", _moga, unit_steps=True, description="MOGA: row(p) on matrices"),
    OptimizerEntry("muon", _muon, unit_steps=True,
                   description="Muon: orthogonalized hidden matrices, AdamW elsewhere (preset moga: spectral on "
                   "every matrix)"),
    # torch's own optimizers take more than a config names (amsgrad, foreach, ...): their keys are listed
    OptimizerEntry("adamw", _torch(torch.optim.AdamW), frozenset({"betas", "eps", "fused"}), default_lr=1e-3,
                   description="torch.optim.AdamW, no width factors"),
    OptimizerEntry("adamw-scaled", _geometry(ScaledAdamW), unit_steps=True,
                   description="rescaled AdamW: lr/fan_in on matrices"),
    OptimizerEntry("sgd", _torch(torch.optim.SGD), frozenset({"momentum", "nesterov", "fused"}), default_lr=1e-2,
                   description="torch.optim.SGD"),
    OptimizerEntry("adaptive-gd", _adaptive, default_lr=1.0,
                   description="the convergence paper's adaptive gradient descent"),
)}
OPTIMIZER_NAMES = tuple(OPTIMIZERS)


def config_options() -> dict[str, tuple[object, tuple[str, ...]]]:
    """{config key: (its type, the optimizers that read it)} over every optimizer: the training config's optim
    section is made from this (:mod:`moga.train.config`)."""
    out: dict[str, tuple[object, tuple[str, ...]]] = {}
    for e in OPTIMIZERS.values():
        reached = getattr(e.build, "passes_to", None)
        types = signature_types(e.build, *([reached] if reached else []))
        for key in sorted(e.keys):
            kind, readers = out.get(key, (types.get(key, typing.Any), ()))
            out[key] = (kind, (*readers, e.name))
    return out
UNIT_STEP_OPTIMIZERS = tuple(n for n, e in OPTIMIZERS.items() if e.unit_steps)
