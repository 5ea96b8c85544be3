"""CIFAR ResNets of two-convolution BasicBlocks, as in the depth paper's section 4.2.

Stages (2,2,2,2), (3,4,6,3), (8,8,8,8) are its "ResNet18/34/66", with K = 8, 16, 32 residual blocks.
A CIFAR stem (3x3 conv, stride 1, no max-pool), stage widths ``base_channels * 2**i``, stride 2 at the
start of every stage but the first, global average pooling and a linear head. Each block computes
``relu(shortcut(x) + alpha * branch(x))``: alpha scales the branch only, never the projection shortcut.
``norm="none"`` drops BatchNorm (the convolutions then get biases). Init follows torchvision's ResNet
(Kaiming normal, fan_out, for convolutions; BatchNorm gains 1, biases 0).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moga.depth import residual_scales, scale_residual_branches
from moga.models.common import check_positive_int, seeded

NORMS = ("batch", "none")
PAPER_STAGES = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3), "resnet66": (8, 8, 8, 8)}


def _channel_norm(kind: str, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.Identity()


def _conv(c_in: int, c_out: int, kernel: int, stride: int, norm: str) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=norm == "none")


class BasicBranch(nn.Module):
    """conv3x3 - norm - relu - conv3x3 - norm: the residual branch f_k."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = _conv(c_in, c_out, 3, stride, norm)
        self.norm1 = _channel_norm(norm, c_out)
        self.conv2 = _conv(c_out, c_out, 3, 1, norm)
        self.norm2 = _channel_norm(norm, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x)))))


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        self.branch = BasicBranch(c_in, c_out, stride, norm)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:  # projection shortcut: a 1x1 conv, not scaled
            self.shortcut = nn.Sequential(_conv(c_in, c_out, 1, stride, norm), _channel_norm(norm, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.shortcut(x) + self.branch(x))  # the branch output carries alpha (moga.depth)

    def residual_branches(self) -> list[nn.Module]:
        return [self.branch]


class CifarResNet(nn.Module):
    def __init__(
        self,
        stages: tuple[int, ...] = (2, 2, 2, 2),
        base_channels: int = 64,
        num_classes: int = 10,
        in_channels: int = 3,
        norm: str = "batch",
        alpha: float = 1.0,
        seed: int | None = None,
    ):
        super().__init__()
        if isinstance(stages, str):
            if stages not in PAPER_STAGES:
                raise ValueError(f"unknown stages {stages!r}; give a tuple of block counts or one of "
                                 f"{sorted(PAPER_STAGES)}")
            stages = PAPER_STAGES[stages]
        stages = tuple(stages)
        if not stages:
            raise ValueError("stages must hold at least one block count")
        check_positive_int(base_channels=base_channels, num_classes=num_classes, in_channels=in_channels,
                           **{f"stages[{i}]": n for i, n in enumerate(stages)})
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        self.stages = stages
        self.depth = sum(stages)  # K, the number of residual blocks
        with seeded(seed):
            stem_conv = _conv(in_channels, base_channels, 3, 1, norm)
            self.stem = nn.Sequential(stem_conv, _channel_norm(norm, base_channels), nn.ReLU())
            blocks, c_in = [], base_channels
            for i, n in enumerate(stages):
                c_out = base_channels * 2**i
                for j in range(n):
                    blocks.append(BasicBlock(c_in, c_out, 2 if (i > 0 and j == 0) else 1, norm))
                    c_in = c_out
            self.blocks = nn.Sequential(*blocks)
            self.head = nn.Linear(c_in, num_classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)
        scale_residual_branches(self, alpha, verify=False)  # declared branches, checked in tests

    @property
    def alpha(self) -> float:
        return next(iter(residual_scales(self).values()), 1.0)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's output, before pooling."""
        return self.blocks(self.stem(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))
