"""CIFAR ResNets of BasicBlocks: the paper's stage configurations, stems, alpha on branches only, plans."""

import pytest
import torch
from torch import nn

from moga.depth import residual_scales
from moga.models import CifarResNet
from moga.roles import build_plan


@pytest.mark.parametrize("stages,k", [((2, 2, 2, 2), 8), ((3, 4, 6, 3), 16), ((8, 8, 8, 8), 32), ("resnet66", 32)])
def test_paper_stage_configurations_count_blocks(stages, k):
    model = CifarResNet(stages, base_channels=2)
    assert model.depth == k and len(residual_scales(model)) == k
    assert all(name.endswith(".branch") for name in residual_scales(model))  # shortcuts are never scaled


def test_cifar_stem_widths_and_shapes():
    model = CifarResNet((1, 1, 1, 1), base_channels=4, num_classes=7, seed=0)
    stem_conv = model.stem[0]
    assert stem_conv.kernel_size == (3, 3) and stem_conv.stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    assert model.features(torch.randn(2, 3, 32, 32)).shape == (2, 32, 4, 4)  # widths 4..32, three stride-2 stages
    gray = CifarResNet((1, 1), base_channels=4, in_channels=1)
    assert gray(torch.randn(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("norm", ["batch", "none"])
def test_alpha_scales_the_branch_not_the_shortcut(norm):
    """alpha * branch equals the unscaled model with the branch's last layer multiplied by alpha."""
    scaled = CifarResNet((1, 2), base_channels=4, norm=norm, alpha=0.25, seed=0).eval()
    reference = CifarResNet((1, 2), base_channels=4, norm=norm, alpha=1.0, seed=0).eval()
    with torch.no_grad():
        for block in reference.blocks:
            last = block.branch.norm2 if norm == "batch" else block.branch.conv2
            last.weight.mul_(0.25)
            last.bias.mul_(0.25)
    assert isinstance(reference.blocks[1].shortcut, nn.Sequential)  # a projection, left as it is
    x = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(scaled(x), reference(x))


def test_normalization_free_option():
    model = CifarResNet((1, 1), base_channels=4, norm="none")
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert all(m.bias is not None for m in model.modules() if isinstance(m, nn.Conv2d))
    assert any(isinstance(m, nn.BatchNorm2d) for m in CifarResNet((1, 1), base_channels=4).modules())
    with pytest.raises(ValueError, match="norm"):
        CifarResNet(norm="layer")


def test_role_plan_needs_no_overrides():
    roles = build_plan(CifarResNet((1, 1), base_channels=4)).roles()
    assert roles["head.weight"] == "readout"
    assert {r for n, r in roles.items() if n.endswith("weight") and "conv" in n} == {"conv"}
    assert roles["blocks.1.shortcut.0.weight"] == "conv"
    assert {r for n, r in roles.items() if "norm" in n or n.endswith("bias")} == {"vector"}
