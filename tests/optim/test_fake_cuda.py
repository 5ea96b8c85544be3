"""One step of every optimizer traced on fake CUDA tensors (a CPU-only torch suffices): no host sync, no copy
from the host, no op mixing devices, and at most a budget of device ops per step, so a regression in launches
fails here before any GPU sees it. See tests/fake_cuda.py for how the trace works."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import moga.kernels.available
from moga.hardware import assume
from moga.optim import MOGA, Muon, ScaledAdamW

from ..fake_cuda import HostSync, fake_cuda, trace


class Net(nn.Module):
    """Ten parameters in every role: an embedding, hidden and readout matrices, biases, norm gains."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm1, self.norm2 = nn.LayerNorm(16), nn.LayerNorm(16)
        self.hidden1, self.hidden2 = nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)


def fake_net(dtype: torch.dtype) -> nn.Module:
    """Net with fake CUDA parameters and gradients (call inside fake_cuda())."""
    with torch.device("meta"):
        net = Net()
    for module in net.modules():
        for name, p in [(k, v) for k, v in module._parameters.items() if v is not None]:
            module._parameters[name] = nn.Parameter(torch.empty(p.shape, device="cuda", dtype=dtype))
    for p in net.parameters():
        p.grad = torch.empty_like(p)
    return net


OPTIMIZERS = {
    "moga": lambda m, **kw: MOGA(m, **kw),
    "moga-plain": lambda m, **kw: MOGA(m, nesterov=False, **kw),  # the papers' momentum (the default's: Nesterov)
    "moga-ignore": lambda m, **kw: MOGA(m, nonfinite="ignore", **kw),
    "moga-p1.5-sign": lambda m, **kw: MOGA(m, p=1.5, vectors="sign", **kw),
    "moga-p-inf": lambda m, **kw: MOGA(m, p=float("inf"), **kw),
    "moga-col": lambda m, **kw: MOGA(m, geometries={"hidden": "col(q=2)", "readout": "col(q=3)"}, **kw),
    "muon": lambda m, **kw: Muon(m, **kw),
    "scaled-adamw": lambda m, **kw: ScaledAdamW(m, **kw),
}
PRECISIONS = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {}),
    "bf16-master": (torch.bfloat16, {"master_weights": True}),
    "bf16-state": (torch.bfloat16, {"state_dtype": torch.bfloat16}),
}

# Device ops of one steady-state step (the second), measured; lower is better, more fails.
# bfloat16 gradients on CUDA add an aminmax, stack and cast each (torch's AMP check has no bfloat16 kernel there).
BUDGET = {  # (optimizer, kernel): ops for fp32, bf16, bf16-master, bf16-state
    ('moga', 'torch'): (195, 420, 430, 258),
    ('moga', 'auto'): (26, 420, 430, 61),
    ('moga-plain', 'torch'): (183, 408, 418, 246),
    ('moga-plain', 'auto'): (26, 408, 418, 61),
    ('moga-ignore', 'torch'): (150, 261, 271, 162),
    ('moga-ignore', 'auto'): (18, 261, 271, 18),
    ('moga-p1.5-sign', 'torch'): (272, 357, 367, 377),
    ('moga-p1.5-sign', 'auto'): (103, 357, 367, 180),
    ('moga-p-inf', 'torch'): (156, 381, 391, 219),
    ('moga-p-inf', 'auto'): (112, 381, 391, 168),
    ('moga-col', 'torch'): (195, 420, 430, 258),
    ('moga-col', 'auto'): (26, 420, 430, 61),
    ('muon', 'torch'): (353, 543, 553, 381),
    ('muon', 'auto'): (309, 543, 553, 330),
    ('scaled-adamw', 'torch'): (37, 377, 387, 72),
    ('scaled-adamw', 'auto'): (37, 377, 387, 72),
}


def traced_step(name: str, precision: str, kernel: str, steps: int = 2):
    dtype, options = PRECISIONS[precision]
    with fake_cuda(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warnings of the fake device are not the point here
        net = fake_net(dtype)
        opt = OPTIMIZERS[name](net, kernel=kernel, **options)
        for _ in range(steps - 1):
            opt.step()
        return trace(opt.step), opt


@pytest.fixture
def fused_cuda_step(monkeypatch):
    """kernel="auto" as on a GPU machine: the fused CUDA step available (its custom op's fake kernel stands
    in; the step itself, the reference, is tested in tests/kernels)."""
    monkeypatch.setitem(moga.kernels.available._unavailable, "cuda", "")
    yield


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("kernel", ["torch", "auto"])
def test_a_step_on_cuda_never_waits_for_the_host_or_mixes_devices(name, precision, kernel, request):
    if kernel == "auto":
        request.getfixturevalue("fused_cuda_step")
    step, opt = traced_step(name, precision, kernel)
    assert step.syncs == [] and step.host_to_device == [] and step.mixed == []
    assert all(t.device.type == "cuda" for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    budget = BUDGET[name, kernel][list(PRECISIONS).index(precision)]
    assert step.count <= budget, (step.count, budget, step.ops.most_common(12))


def test_the_trace_sees_host_reads_host_copies_and_mixed_devices():
    with fake_cuda():
        x = torch.zeros(3, device="cuda")
        assert trace(lambda: torch.tensor(0.5, device="cuda")).host_to_device == ["_to_copy at ?"]
        assert trace(lambda: x.add_(torch.tensor(0.5))).mixed == ["add_ on ['cpu', 'cuda'] at ?"]
        assert len(trace(lambda: x.cpu()).syncs) == 1
        with pytest.raises(HostSync, match="_local_scalar_dense"):
            trace(lambda: float(x.sum()))
        net = fake_net(torch.float32)
        opt = MOGA(net, nonfinite="raise", kernel="torch")  # documented: it reads the flag every step
        with pytest.raises(HostSync, match=r"optim/nonfinite.py:\d+"):
            trace(opt.step)


def test_the_nonfinite_check_is_one_launch_per_dtype_it_takes():
    """torch's AMP check over all gradients of a dtype, not a min, max, stack and cast per gradient; bfloat16,
    which its CUDA kernel lacks, by the extremes."""
    with fake_cuda():
        params = [nn.Parameter(torch.empty(8, 4, device="cuda", dtype=dtype))
                  for dtype in (torch.float32, torch.bfloat16) for _ in range(3)]
        for p in params:
            p.grad = torch.empty_like(p)
        opt = MOGA([{"params": params[:3]}, {"params": params[3:]}], geometry="row(p=2)", kernel="torch")
        step = trace(opt.step)
    assert step.ops["_amp_foreach_non_finite_check_and_unscale_"] == 1 and step.ops["aminmax"] == 3


def test_gradients_the_check_cannot_write_are_checked_by_their_extremes():
    """The AMP check multiplies in place by 1; an expanded (stride 0) gradient takes the min/max path."""
    p = nn.Parameter(torch.zeros(4, 6))
    opt = MOGA([p], geometry="row(p=2)", kernel="torch")
    p.grad = torch.tensor(float("nan")).expand(4, 6)
    opt.step()
    assert opt.skipped_steps == 1 and torch.equal(p, torch.zeros(4, 6))
    p.grad = torch.tensor(1.0).expand(4, 6)
    opt.step()
    assert opt.skipped_steps == 1 and not torch.equal(p, torch.zeros(4, 6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_finite_check_gives_cuda_only_the_dtypes_its_amp_check_takes(dtype):
    # torch's CUDA _amp_foreach_non_finite_check_and_unscale_ has no bfloat16 kernel: a bfloat16 model with
    # master weights stopped there on an H200; bfloat16 goes by its min and max instead
    from moga.optim.nonfinite import all_finite_foreach

    with fake_cuda():
        tensors = [torch.ones(4, 3, dtype=dtype, device="cuda"), torch.ones(5, dtype=dtype, device="cuda")]
        step = trace(lambda: all_finite_foreach(tensors, tensors[0].device))
    amp = step.ops["_amp_foreach_non_finite_check_and_unscale_"]
    assert (amp == 0) == (dtype == torch.bfloat16) and step.syncs == []
