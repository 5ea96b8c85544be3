"""The options every geometry optimizer shares, declared once, and the checks of their values.

:class:`~moga.optim.base.GeometryOptimizer` takes all of them; MOGA, Muon and ScaledAdamW declare only what
differs (their defaults for ``lr`` and momentum, their own keywords) and pass the rest through as
``**options``, so a shared option's name, default and check live here alone.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Mapping
from typing import TypedDict

import torch


class SharedOptions(TypedDict, total=False):
    """The keyword-only options of every geometry optimizer (defaults: :data:`SHARED_DEFAULTS`)."""

    betas: tuple[float, float]  # Adam's, for the groups with update="adam"
    eps: float
    geometries: Mapping[str, str] | None  # {role: geometry spec} in place of the optimizer's (a model only)
    overrides: Mapping | None  # {parameter glob: role} for the role plan (a model only)
    lr_multipliers: Mapping[str, float] | None  # {role: factor} on lr (a model or plan only)
    nonfinite: str  # "skip", "raise" or "ignore" (moga.optim.nonfinite)
    state_dtype: torch.dtype | str  # momentum and Adam moments: float32 or bfloat16
    master_weights: bool  # a float32 copy of each 16-bit parameter takes the step
    distributed: bool | None  # split whole-matrix work among replicated ranks (None: when initialized)
    kernel: str  # "auto", "cpp" or "torch" (moga.kernels)


SHARED_DEFAULTS: SharedOptions = dict(
    betas=(0.9, 0.999), eps=1e-8, geometries=None, overrides=None, lr_multipliers=None, nonfinite="skip",
    state_dtype=torch.float32, master_weights=False, distributed=None, kernel="auto",
)


def shared(cls: type, options: dict) -> dict:
    """``options`` as passed on by ``cls``'s ``**options``: shared options only (a class fixes the rest, such
    as Muon's geometry or ScaledAdamW's update, and must not let one through unread)."""
    unknown = sorted(set(options) - set(SharedOptions.__annotations__))
    if unknown:
        raise TypeError(f"{cls.__name__}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; besides "
                        f"its own it takes the shared options {', '.join(SharedOptions.__annotations__)}")
    return options


def real(name: str, v) -> float:
    """A finite real number of any kind (int, float, numpy scalar, 0-d tensor) as a Python float."""
    if isinstance(v, torch.Tensor) and v.ndim == 0 and not v.is_complex() and v.dtype != torch.bool:
        v = v.item()  # at construction only, never in step
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number (any real type), got {v!r}")
    return float(v)


def check_hyperparameters(h: dict) -> None:
    """Clear errors for values no run should start with; numbers are stored as Python floats."""
    h["lr"] = real("lr", h["lr"])
    if h["lr"] < 0:
        raise ValueError(f"lr must be >= 0, got {h['lr']}")
    h["momentum"] = real("momentum", h["momentum"])
    if not 0 <= h["momentum"] < 1:
        raise ValueError(f"momentum must be in [0, 1), got {h['momentum']}")
    h["weight_decay"] = real("weight_decay", h["weight_decay"])
    if h["weight_decay"] < 0:
        raise ValueError(f"weight_decay must be >= 0, got {h['weight_decay']}")
    betas = h["betas"]
    if len(betas) != 2 or not all(0 <= real("betas", b) < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    h["betas"] = tuple(real("betas", b) for b in betas)
    h["eps"] = real("eps", h["eps"])
    if h["eps"] <= 0:
        raise ValueError(f"eps must be > 0, got {h['eps']}")
    if not isinstance(h["nesterov"], bool):
        raise ValueError(f"nesterov must be True or False, got {h['nesterov']!r}")
    if h.get("update", "lmo") not in ("lmo", "adam"):
        raise ValueError(f"update must be 'lmo' or 'adam', got {h['update']!r}")


def warn_if_decay_diverges(param_groups, stacklevel: int = 3) -> None:
    """Decoupled decay multiplies W by (1 - lr*wd) each step: past lr*wd = 1 that flips every weight's sign,
    past 2 it grows them without bound (inf within tens of steps). A likely unit mix-up; warn, once."""
    worst = max((g["lr"] * g["weight_decay"] for g in param_groups
                 if isinstance(g.get("lr"), (int, float)) and g.get("weight_decay")), default=0.0)
    if worst > 1:
        warnings.warn(f"lr x weight_decay = {worst:.3g} > 1: each step multiplies the weights by (1 - lr*wd) = "
                      f"{1 - worst:.3g}, flipping their sign{' and growing them to inf' if worst > 2 else ''}. "
                      "Weight decay here is decoupled (scaled by lr): use weight_decay below 1/lr", stacklevel=stacklevel)


def warn_if_trainer_arguments_ignored(optimizer, lr: float, weight_decay: float) -> None:
    """Hugging Face's Trainer, given ``optimizer_cls_and_kwargs=(MOGA, kwargs)``, builds the optimizer from
    those kwargs alone: its TrainingArguments' ``learning_rate`` and ``weight_decay`` reach no parameter.
    Say so once when they differ from what the optimizer steps with. The Trainer is found on the call stack
    by what it holds (``optimizer_cls_and_kwargs``, ``args``), so transformers is never imported here."""
    args = _building_trainer_arguments(optimizer)
    if args is None:
        return
    theirs = (getattr(args, "learning_rate", None), getattr(args, "weight_decay", None))
    if all(isinstance(v, numbers.Real) and math.isclose(v, mine) for v, mine in zip(theirs, (lr, weight_decay))):
        return
    name = type(optimizer).__name__
    warnings.warn(
        f"Trainer(optimizer_cls_and_kwargs=({name}, ...)) builds {name} from those kwargs alone: it steps at lr "
        f"{lr:g} with weight_decay {weight_decay:g}, and TrainingArguments' learning_rate {theirs[0]:g} and "
        f"weight_decay {theirs[1]:g} are ignored (Trainer's schedule and logged learning_rate follow the "
        f"optimizer's). Give both the same values, or build it with moga.integrations.hf.create_optimizer(model, "
        f"args), which reads them", stacklevel=2)


def _building_trainer_arguments(optimizer, frames: int = 12):
    """The ``args`` of a Trainer whose ``create_optimizer`` is building ``optimizer`` from its
    ``optimizer_cls_and_kwargs``, when one is on the call stack; else None."""
    frame = inspect.currentframe()
    for _ in range(frames):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        chosen = getattr(owner, "optimizer_cls_and_kwargs", None) if frame.f_code.co_name == "create_optimizer" else None
        if isinstance(chosen, tuple) and chosen and isinstance(chosen[0], type) and isinstance(optimizer, chosen[0]):
            return getattr(owner, "args", None)
    return None
