"""Loading state: another optimizer's or another model's state is an error naming the first mismatch,
and the optimizer is left as it was."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from moga.optim import MOGA, Muon, ScaledAdamW

from .test_base import train
from .tinynet import TINY_OVERRIDES, TinyNet


def trained(make, model=None):
    model = model or TinyNet()
    opt = make(model)
    train(model, opt, 1)
    return model, opt


@pytest.mark.parametrize("source,target,match", [
    (Muon, MOGA, r"param group \d+ \(\w+\): the state dict's geometry is 'spectral.*this optimizer's 'row\(p=2\)'"),
    (MOGA, Muon, r"geometry is 'row\(p=2\)'"),
    (lambda m, **kw: MOGA(m, p=1.5, **kw), MOGA, r"'row\(p=1.5\)'.*'row\(p=2\)'"),
    (ScaledAdamW, MOGA, r"geometry is 'sign'"),
])
def test_another_optimizers_state_is_refused(source, target, match):
    _, theirs = trained(lambda m: source(m, overrides=TINY_OVERRIDES))
    model, ours = trained(lambda m: target(m, overrides=TINY_OVERRIDES))
    before = {k: {n: v.clone() for n, v in s.items()} for k, s in ours.state_dict()["state"].items()}
    with pytest.raises(ValueError, match=match):
        ours.load_state_dict(theirs.state_dict())
    after = ours.state_dict()
    assert [g["geometry"] for g in after["param_groups"]] == [g["geometry"] for g in ours.param_groups]
    for k, s in after["state"].items():
        assert all(torch.equal(v, before[k][n]) for n, v in s.items())


def test_torch_optimizer_state_is_refused():
    model = TinyNet()
    adamw = torch.optim.AdamW(model.parameters())
    ours = MOGA([{"params": list(model.parameters())[:1], "geometry": "vector"}])
    with pytest.raises(ValueError, match="param groups|no geometry"):
        ours.load_state_dict(adamw.state_dict())


def test_state_of_another_shape_names_the_parameter():
    def make(width):
        model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))
        opt = MOGA(model)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        return opt

    with pytest.raises(ValueError, match=r"0\.weight: state 'momentum_buffer' has shape \(8, 4\), expected \(6, 4\)"):
        make(6).load_state_dict(make(8).state_dict())


def test_scaled_adamw_with_state_of_other_shapes_fails_cleanly():
    """This corrupted the heap in torch's fused kernel (exit 134); in a subprocess, a crash fails the test."""
    code = textwrap.dedent("""
        import torch
        from torch import nn
        from moga.optim import ScaledAdamW

        def make(width):
            model = nn.Sequential(nn.Embedding(10, width), nn.Linear(width, width), nn.Linear(width, 10))
            opt = ScaledAdamW(model)
            model(torch.tensor([[1, 2, 3]])).sum().backward()
            opt.step()
            return model, opt

        big_model, big = make(64)
        model, opt = make(8)
        try:
            opt.load_state_dict(big.state_dict())
        except ValueError as e:
            print("refused:", e)
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        opt.step()
        print("finite:", all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: param group 0 (embedding), 0.weight: state 'exp_avg' has shape (10, 64)" in run.stdout
    assert "finite: True" in run.stdout
