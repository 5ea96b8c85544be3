"""The depth paper's residual MLP (its figure 1): input layer, K two-layer branches, readout.

``y_0 = W_in x``, ``y_k = y_{k-1} + alpha * W2_k s(W1_k y_{k-1})``, output ``W_out y_K``. The width is the
same in every branch and at every depth; only K changes. ``alpha = K_base / K`` (``moga.depth.residual_alpha``)
is the paper's scaled model, ``alpha = 1`` its unscaled baseline. Layers keep PyTorch's default init.
"""

from __future__ import annotations

import torch
from torch import nn

from moga.depth import residual_scales, scale_residual_branches
from moga.models.common import activation, check_positive_int, seeded


class MLPBranch(nn.Module):
    """``f_k(y) = W2 s(W1 y)``: a branch of block depth 2."""

    def __init__(self, width: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.act = activation(act)
        self.fc2 = nn.Linear(width, width)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(y)))


class ResidualBlock(nn.Module):
    def __init__(self, width: int, act: str):
        super().__init__()
        self.branch = MLPBranch(width, act)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y + self.branch(y)  # the branch output carries alpha (its residual_scale, moga.depth)

    def residual_branches(self) -> list[nn.Module]:
        return [self.branch]


class ResidualMLP(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        width: int = 128,
        depth: int = 4,
        activation: str = "gelu",
        alpha: float = 1.0,
        seed: int | None = None,
    ):
        super().__init__()
        check_positive_int(in_features=in_features, out_features=out_features, width=width, depth=depth)
        self.depth = depth  # K, the number of residual branches
        with seeded(seed):  # registration order is call order: input, blocks, readout (the role plan's rule)
            self.input = nn.Linear(in_features, width)
            self.blocks = nn.ModuleList(ResidualBlock(width, activation) for _ in range(depth))
            self.readout = nn.Linear(width, out_features)
        scale_residual_branches(self, alpha, verify=False)  # declared branches, checked in tests

    @property
    def alpha(self) -> float:
        return next(iter(residual_scales(self).values()), 1.0)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The final hidden state ``y_K``; images are flattened."""
        y = self.input(x.flatten(1))
        for block in self.blocks:
            y = block(y)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(self.features(x))
