"""Small pieces every model shares: activations by name and seeded initialization."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "softplus": nn.Softplus,
    "relu": nn.ReLU,
    "identity": nn.Identity,
}
# Linearly bounded, Lipschitz and Lipschitz-smooth: the convergence paper's Assumption 3.1 (its C.11).
SMOOTH_ACTIVATIONS = ("gelu", "silu", "tanh", "sigmoid", "softplus", "identity")


def activation(name: str, allowed: tuple[str, ...] = tuple(ACTIVATIONS)) -> nn.Module:
    if name not in allowed:
        raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(allowed)}")
    return ACTIVATIONS[name]()


@contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Build modules with the CPU generator seeded to ``seed``, leaving the global RNG as it was.

    The same seed gives the same initial weights; ``None`` draws from the global RNG (``torch.manual_seed``).
    """
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def check_positive_int(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
