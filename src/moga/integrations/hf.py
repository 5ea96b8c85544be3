"""Build a moga optimizer from Hugging Face ``TrainingArguments``, for ``Trainer`` and Accelerate.

>>> opt = create_optimizer(model, args, name="moga")            # lr, weight decay, betas, eps from args
>>> trainer = Trainer(model, args, train_dataset=..., optimizers=(opt, None))  # Trainer adds its schedule

Neither transformers nor accelerate is imported here: ``args`` is read by attribute, so any object with
``learning_rate``, ``weight_decay``, ``adam_beta1``, ``adam_beta2`` and ``adam_epsilon`` will do.
"""

from __future__ import annotations

import inspect
import warnings

from torch import nn

from moga.optim import MOGA, Muon, ScaledAdamW
from moga.optim.base import GeometryOptimizer
from moga.optim.muon import MUON_DEFAULT, muon_preset
from moga.optim.registry import OPTIMIZERS as REGISTRY
from moga.optim.registry import UNIT_STEP_OPTIMIZERS as OPTIMIZERS

_CLASSES = {"moga": MOGA, "muon": Muon, "adamw-scaled": ScaledAdamW}
_ALIASES = {"scaled-adamw": "adamw-scaled", "scaledadamw": "adamw-scaled"}


def create_optimizer(model: nn.Module, args, name: str = "moga", **kwargs) -> GeometryOptimizer:
    """``name`` ("moga", "muon", "adamw-scaled") built on ``model``'s role plan with the arguments' lr,
    weight decay, betas and eps; ``kwargs`` (``lr=``, ``p=``, ``momentum=``, ``overrides=``...) win over them.

    Weight decay skips biases and norm gains (the plan's vector role), as everywhere in moga and in
    Trainer's own optimizers. The betas and eps are Adam's, so they reach the groups that use Adam's
    direction (vectors, and every matrix of ``adamw-scaled``); MOGA's and Muon's matrices use ``momentum``.
    ``TrainingArguments``' default learning rate is an AdamW rate, far below these optimizers' unit steps:
    left at that default (and without ``lr=``), it is used, with a one-line warning.
    """
    key = _ALIASES.get(name.lower().replace("_", "-"), name.lower().replace("_", "-"))
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    model = getattr(model, "module", model)  # a DDP / Accelerate wrapper holds the model in .module
    if "lr" not in kwargs and args.learning_rate == _default_learning_rate(args):
        own = inspect.signature(_CLASSES[key]).parameters["lr"].default
        if own is None:  # a preset's (Muon's)
            own = muon_preset(kwargs.get("preset", MUON_DEFAULT)).lr
        warnings.warn(f"learning_rate is TrainingArguments' default {args.learning_rate:g}, an AdamW rate; "
                      f"{key}'s unit steps want about {own:g} (its default): set TrainingArguments(learning_rate=...)"
                      " or pass lr=", stacklevel=2)
    hyper = {
        "lr": args.learning_rate, "weight_decay": args.weight_decay,
        "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, **kwargs,
    }
    return REGISTRY[key].build(model, **hyper)


def _default_learning_rate(args) -> float | None:
    """The learning rate ``args`` has when nobody sets it (transformers' dataclass field default)."""
    field = getattr(type(args), "__dataclass_fields__", {}).get("learning_rate")
    return getattr(field, "default", None) if field is not None else None
