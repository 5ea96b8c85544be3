"""A user's model factory for `moga coordcheck --model tests.experiments.coordcheck_factory:mlp`."""

from torch import nn


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))
