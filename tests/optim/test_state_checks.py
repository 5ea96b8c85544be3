"""Loading state: another optimizer's or another model's state is an error naming the first mismatch,
and the optimizer is left as it was."""

import copy
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


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_a_parameter_reshaped_between_steps_is_refused_on_both_paths(kernel, momentum):
    """The C++ kernel stepped the (6, 4) weight with the (4, 6) momentum, silently."""
    w = nn.Parameter(torch.randn(4, 6))
    opt = MOGA([w], geometry="row(p=2)", momentum=momentum, kernel=kernel)
    w.grad = torch.randn(4, 6)
    opt.step()
    w.data = w.data.reshape(6, 4)
    w.grad = torch.randn(6, 4)
    before, state = w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}
    with pytest.raises(RuntimeError, match=r"params\[0\]: the parameter's shape changed from \(4, 6\) to \(6, 4\)"):
        opt.step()
    assert torch.equal(w, before) and all(torch.equal(v, state[k]) for k, v in opt.state[w].items())


@pytest.mark.parametrize("make,key,value", [
    (MOGA, "momentum_buffer", float("nan")),
    (MOGA, "momentum_buffer", float("inf")),
    (MOGA, "exp_avg", float("nan")),
    (ScaledAdamW, "exp_avg_sq", float("-inf")),
    (ScaledAdamW, "exp_avg_sq", -1.0),
    (ScaledAdamW, "step", float("nan")),
    (lambda m, **kw: MOGA(m, master_weights=True, **kw), "master", float("nan")),
])
def test_non_finite_state_is_refused_at_load(make, key, value):
    """A NaN in a loaded momentum passed load_state_dict, then NaN'd a whole row (C++) or one weight (plain)."""
    model = TinyNet().to(torch.bfloat16) if key == "master" else TinyNet()
    _, opt = trained(lambda m: make(m, overrides=TINY_OVERRIDES), model)
    state = copy.deepcopy(opt.state_dict())  # not the live tensors
    index = next(i for i, s in state["state"].items() if key in s)
    state["state"][index][key].view(-1)[0] = value
    before = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
    with pytest.raises(ValueError, match=rf"state '{key}' holds (NaN or inf|a negative value)"):
        opt.load_state_dict(state)
    after = opt.state_dict()["state"]
    assert all(torch.equal(v, before[k][n]) for k, s in after.items() for n, v in s.items())
