"""The papers' models in plain PyTorch: configurable width and depth, seeded init, role plans from the core.

``build_model(name, **kwargs)`` builds one by name; ``plan_for(model)`` is its role plan, with whatever
overrides the model itself declares (only a GPT with a tied head declares one).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from moga.models.feedforward import FeedForward, SharedWeightsNet
from moga.models.gpt import GPT, GPTConfig
from moga.models.residual_mlp import ResidualMLP
from moga.models.resnet import CifarResNet
from moga.roles import RolePlan, build_plan

MODELS: dict[str, type[nn.Module]] = {
    "residual_mlp": ResidualMLP,
    "gpt": GPT,
    "resnet": CifarResNet,
    "feedforward": FeedForward,
    "shared_weights": SharedWeightsNet,
}


def build_model(name: str, **kwargs) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}")
    return MODELS[name](**kwargs)


def plan_for(
    model: nn.Module,
    geometries: Mapping[str, str] | None = None,
    overrides: Mapping | None = None,
    example_inputs=None,
) -> RolePlan:
    """``build_plan`` with the model's own ``plan_overrides()`` (if any) under the caller's ``overrides``."""
    own = model.plan_overrides() if callable(getattr(model, "plan_overrides", None)) else {}
    return build_plan(model, geometries, {**own, **(overrides or {})}, example_inputs)


__all__ = [
    "MODELS", "build_model", "plan_for",
    "ResidualMLP", "GPT", "GPTConfig", "CifarResNet", "FeedForward", "SharedWeightsNet",
]
