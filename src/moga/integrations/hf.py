"""Build a moga optimizer from Hugging Face ``TrainingArguments``, for ``Trainer`` and Accelerate.

>>> opt = create_optimizer(model, args, name="moga")            # lr, weight decay, betas, eps from args
>>> trainer = Trainer(model, args, train_dataset=..., optimizers=(opt, None))  # Trainer adds its schedule

Neither transformers nor accelerate is imported here: ``args`` is read by attribute, so any object with
``learning_rate``, ``weight_decay``, ``adam_beta1``, ``adam_beta2`` and ``adam_epsilon`` will do.
"""

from __future__ import annotations

from torch import nn

from moga.optim.base import GeometryOptimizer
from moga.optim.registry import OPTIMIZERS as REGISTRY
from moga.optim.registry import UNIT_STEP_OPTIMIZERS as OPTIMIZERS

_ALIASES = {"scaled-adamw": "adamw-scaled", "scaledadamw": "adamw-scaled"}


def create_optimizer(model: nn.Module, args, name: str = "moga", **kwargs) -> GeometryOptimizer:
    """``name`` ("moga", "muon", "adamw-scaled") built on ``model``'s role plan with the arguments' lr,
    weight decay, betas and eps; ``kwargs`` (``p=``, ``momentum=``, ``overrides=``...) win over them.

    As in Trainer's own optimizers, weight decay skips biases and norm gains (the plan's vector role).
    The betas and eps are Adam's, so they reach the groups that use Adam's direction (vectors, and every
    matrix of ``adamw-scaled``); MOGA's and Muon's matrices use ``momentum``.
    """
    key = _ALIASES.get(name.lower().replace("_", "-"), name.lower().replace("_", "-"))
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    model = getattr(model, "module", model)  # a DDP / Accelerate wrapper holds the model in .module
    hyper = {
        "lr": args.learning_rate, "weight_decay": args.weight_decay,
        "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, **kwargs,
    }
    optimizer = REGISTRY[key].build(model, **hyper)
    for group in optimizer.param_groups:
        if group.get("role") == "vector":
            group["weight_decay"] = 0.0
    return optimizer
