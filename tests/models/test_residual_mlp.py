"""The depth paper's residual MLP (figure 1): structure, alpha, forward stability across depth, role plan."""

import pytest
import torch
from torch.nn import functional as F

from moga.depth import residual_alpha
from moga.models import ResidualMLP
from moga.roles import build_plan

from .stability import block_grad_norms, check_depth_stability, rms


def test_shapes_and_fixed_width():
    model = ResidualMLP(3 * 8 * 8, 10, width=16, depth=5, seed=0)
    assert model(torch.randn(4, 3, 8, 8)).shape == (4, 10)  # images are flattened
    assert model.depth == 5 and len(model.blocks) == 5
    assert {tuple(b.branch.fc1.weight.shape) for b in model.blocks} == {(16, 16)}


def test_alpha_scales_each_branch_output():
    """alpha * W2 s(W1 y) equals the unscaled model with W2 and its bias multiplied by alpha."""
    scaled = ResidualMLP(6, 2, width=8, depth=3, alpha=0.25, activation="tanh", seed=3)
    reference = ResidualMLP(6, 2, width=8, depth=3, alpha=1.0, activation="tanh", seed=3)
    with torch.no_grad():
        for block in reference.blocks:
            block.branch.fc2.weight.mul_(0.25)
            block.branch.fc2.bias.mul_(0.25)
    x = torch.randn(5, 6)
    assert scaled.alpha == 0.25 and reference.alpha == 1.0
    torch.testing.assert_close(scaled(x), reference(x))
    y = reference.input(x)
    for block in reference.blocks:  # the recursion y_k = y_{k-1} + f_k(y_{k-1}), written out
        y = y + block.branch.fc2(torch.tanh(block.branch.fc1(y)))
    torch.testing.assert_close(scaled.features(x), y)


def test_forward_stability_and_gradient_scaling_across_depth():
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(1))

    def measure(depth, alpha):
        model = ResidualMLP(16, 4, width=32, depth=depth, alpha=alpha, seed=0)
        h = model.features(x)
        F.cross_entropy(model.readout(h), y).backward()
        return rms(h), block_grad_norms(model.blocks).mean().item()

    check_depth_stability(measure)


def test_role_plan_needs_no_overrides():
    roles = build_plan(ResidualMLP(6, 3, width=8, depth=2)).roles()
    assert roles["input.weight"] == "input" and roles["readout.weight"] == "readout"
    assert {r for n, r in roles.items() if n.startswith("blocks") and n.endswith("weight")} == {"hidden"}
    assert {r for n, r in roles.items() if n.endswith("bias")} == {"vector"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="depth"):
        ResidualMLP(4, 2, depth=0)
    with pytest.raises(ValueError, match="activation"):
        ResidualMLP(4, 2, activation="swish")
    with pytest.raises(ValueError, match="alpha"):
        ResidualMLP(4, 2, alpha=0.0)
    assert ResidualMLP(4, 2, depth=8, alpha=residual_alpha(8)).alpha == 0.25
