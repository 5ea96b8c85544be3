"""Faults in the step: non-finite gradients and lr decided on the device with no host sync, and the
inputs that used to crash or corrupt (sparse gradients, zero-size and complex parameters, lr types)."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from moga.optim import MOGA, Muon, ScaledAdamW

from .test_base import FACTORIES, train
from .tinynet import TINY_OVERRIDES, TinyNet, tiny_loss

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}


class RecordFunctions(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS or getattr(func, "__name__", "") in ("to", "copy_") and _to_host(args, kwargs):
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class RecordDispatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def _to_host(args, kwargs):
    """A copy from a non-CPU tensor to the CPU (on a CPU-only machine: none, but the check stays honest)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    target = (kwargs or {}).get("device") or next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
    return bool(tensors) and tensors[0].device.type != "cpu" and torch.device(target or "cpu").type == "cpu"


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "nan"])
def test_step_reads_nothing_back_from_the_device(name, finite, tiny):
    opt = FACTORIES[name](tiny)
    train(tiny, opt, 1)
    tiny.zero_grad()
    tiny_loss(tiny).backward()
    if not finite:
        tiny.hidden.weight.grad[0, 0] = float("nan")
    functions, dispatch = RecordFunctions(), RecordDispatch()
    with functions, dispatch:
        opt.step()
    assert functions.calls == [] and dispatch.calls == []
    assert opt.skipped_steps == (0 if finite else 1)


def test_raise_policy_reads_the_flag_and_says_so(tiny):
    opt = MOGA(tiny, nonfinite="raise", overrides=TINY_OVERRIDES)
    tiny_loss(tiny).backward()
    dispatch = RecordDispatch()
    with dispatch:
        opt.step()
    assert dispatch.calls  # documented: "raise" costs one host read per step


@pytest.mark.parametrize("name", FACTORIES)
def test_a_nan_lr_set_mid_training_skips_the_step(name, tiny):
    opt = FACTORIES[name](tiny)
    train(tiny, opt, 2)
    before = [p.detach().clone() for p in tiny.parameters()]
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
    opt.param_groups[0]["lr"] = float("nan")
    tiny.zero_grad()
    tiny_loss(tiny).backward()
    with pytest.warns(RuntimeWarning, match="non-finite learning rate in group 0"):
        opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), before))
    for k, s in opt.state_dict()["state"].items():
        assert all(torch.equal(v, state[k][n]) for n, v in s.items())
    opt.param_groups[0]["lr"] = float("inf")
    opt.nonfinite = "raise"
    with pytest.raises(FloatingPointError, match="lr=inf"):
        opt.step()


def test_ignore_turns_the_check_off(tiny):
    opt = MOGA(tiny, nonfinite="ignore", momentum=0.0, overrides=TINY_OVERRIDES)
    tiny_loss(tiny).backward()
    tiny.head.bias.grad[0] = float("nan")
    opt.step()  # what a GradScaler that checks by itself would have skipped
    assert opt.skipped_steps == 0 and torch.isnan(tiny.head.bias).any()


@pytest.mark.parametrize("lr", [np.float32(0.03), np.float64(0.03), torch.tensor(0.03), torch.tensor(0.03, dtype=torch.float64), 3])
def test_lr_of_any_real_type(lr, tiny):
    opt = MOGA(tiny, lr=lr, overrides=TINY_OVERRIDES)
    assert isinstance(opt.param_groups[0]["lr"], float) and opt.param_groups[0]["lr"] == pytest.approx(float(lr))
    train(tiny, opt, 1)
    assert all(torch.isfinite(p).all() for p in tiny.parameters())


@pytest.mark.parametrize("lr", [torch.tensor([0.1, 0.2]), torch.tensor(1j), "0.1", True])
def test_lr_that_is_not_one_real_number_is_an_error(lr, tiny):
    with pytest.raises(ValueError, match="lr must be a finite number"):
        MOGA(tiny, lr=lr, overrides=TINY_OVERRIDES)


def test_sparse_gradients_are_a_clear_error():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = MOGA(model)
    model(torch.tensor([[1, 2]])).sum().backward()
    with pytest.raises(RuntimeError, match="do not support sparse gradients"):
        opt.step()


@pytest.mark.parametrize("make", [MOGA, Muon, ScaledAdamW, lambda m: MOGA(m, p=1.5, vectors="sign")])
def test_zero_size_parameters_step_as_no_ops(make):
    model = nn.Sequential(nn.Linear(3, 0), nn.Linear(0, 4), nn.Linear(4, 2))
    opt = make(model)
    model(torch.randn(5, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.isfinite(p).all() and p.shape == b.shape for p, b in zip(model.parameters(), before))
    assert not torch.equal(model[1].bias, before[3]) and not torch.equal(model[2].bias, before[5])


@pytest.mark.parametrize("make", [MOGA, Muon, ScaledAdamW])
def test_complex_parameters_are_refused_at_construction(make):
    w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="params\\[0\\].*complex"):
        make([{"params": [w], "geometry": "row(p=2)"}] if make is MOGA else [w])
