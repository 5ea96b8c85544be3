"""A user's model factory for `moga coordcheck --model tests.experiments.coordcheck_factory:mlp`."""

import torch
from torch import nn


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))


class _Gain(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.gain


def no_matrices(width: int):
    """A model with vectors only: nothing for a coordinate check to measure."""
    g = torch.Generator().manual_seed(0)
    return _Gain(width), torch.randn(32, width, generator=g), torch.randint(0, width, (32,), generator=g)
