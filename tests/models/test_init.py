"""The width-aware init: each matrix's std by its role and plan shape, so that outputs at init keep their
scale across width (the readout's shrinks, as muP's); vectors and tied tables keep the model's own init."""

import math

import pytest
import torch

from moga.models import GPT, ResidualMLP, plan_for
from moga.models.init import width_aware_init, width_aware_std


def test_each_role_gets_its_std_and_vectors_keep_theirs():
    model = ResidualMLP(64, 10, width=256, depth=2, seed=0)
    biases = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("bias")}
    drawn = width_aware_init(model, seed=1)
    assert drawn == pytest.approx({
        "input.weight": 1 / 8,  # 256 x 64: 1/sqrt(fan_in)
        **{f"blocks.{k}.branch.fc{j}.weight": 1 / 16 for k in (0, 1) for j in (1, 2)},  # 256 x 256
        "readout.weight": math.sqrt(10) / 256,  # 10 x 256: muP's readout
    })
    for name, std in drawn.items():
        assert model.get_parameter(name).std().item() == pytest.approx(std, rel=0.05)
    assert all(torch.equal(model.get_parameter(n), b) for n, b in biases.items())
    assert width_aware_std("embedding", 32, 50257) == 1.0


def test_outputs_at_init_keep_their_scale_across_width():
    """nanoGPT's N(0, 0.02^2) makes a hidden layer's output grow like sqrt(width); the width-aware init
    keeps it, and the readout's output shrinks like 1/sqrt(width)."""
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))

    def rms_outputs(width, aware):
        model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=width, seed=0)
        if aware:
            width_aware_init(model, seed=0)
        seen = {}
        hooks = [model.get_submodule(n).register_forward_hook(
            lambda m, a, out, n=n: seen.__setitem__(n, out.pow(2).mean().sqrt().item()))
            for n in ("blocks.1.mlp.c_fc", "lm_head")]
        with torch.no_grad():
            model(tokens)
        for h in hooks:
            h.remove()
        return seen

    small, large = rms_outputs(128, True), rms_outputs(512, True)  # widths above the vocabulary (64)
    assert large["blocks.1.mlp.c_fc"] / small["blocks.1.mlp.c_fc"] == pytest.approx(1, abs=0.1)
    assert large["lm_head"] / small["lm_head"] == pytest.approx(0.5, rel=0.1)  # sqrt(128 / 512)
    small, large = rms_outputs(128, False), rms_outputs(512, False)
    assert large["blocks.1.mlp.c_fc"] / small["blocks.1.mlp.c_fc"] == pytest.approx(2, rel=0.1)  # sqrt(512 / 128)


def test_a_tied_table_keeps_the_models_init():
    model = GPT(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32, tie_weights=True, seed=0)
    table = model.wte.weight.detach().clone()
    drawn = width_aware_init(model, plan=plan_for(model), seed=0)
    assert "wte.weight" not in drawn and "lm_head.weight" not in drawn
    assert torch.equal(model.wte.weight, table)
