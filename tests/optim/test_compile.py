"""``torch.compile(opt.step)`` runs MOGA, Muon and ScaledAdamW with their defaults (Adam on vectors, the
non-finite skip) as one graph, first step included (``fullgraph``), and takes the eager step's values; a
step with a NaN gradient is skipped alike."""

import copy

import pytest
import torch
from torch import nn

from moga.optim import MOGA, Muon, ScaledAdamW

# Muon's default Newton-Schulz dtype is bfloat16 on some CPUs, where compiled and eager round differently:
# float32 here, so the comparison is tight. Inductor is slow to compile on a busy CPU: one case uses it
# (it once returned one buffer for the new step counters of two biases), the others aot_eager, which
# runs the same functionalization that rejected torch._fused_adamw_ and torch._fused_sgd_.
CASES = {
    "moga": (lambda net: MOGA(net), "inductor"),
    "muon": (lambda net: Muon(net, ns_dtype="float32"), "aot_eager"),
    "scaled-adamw": (lambda net: ScaledAdamW(net), "aot_eager"),
}


def train(make, backend, net, steps=3):
    opt = make(net)
    torch._dynamo.reset()
    step = opt.step if backend is None else torch.compile(opt.step, backend=backend, fullgraph=True)  # no break
    gen = torch.Generator().manual_seed(3)
    for k in range(steps + 1):
        opt.zero_grad()
        net(torch.randn(4, 8, generator=gen)).square().mean().backward()
        if k == steps:  # the last step's gradients hold a NaN: skipped, nothing changes
            net[0].bias.grad[0] = float("nan")
            before = [p.detach().clone() for p in net.parameters()]
        step()
    return opt, before


@pytest.mark.parametrize("name", CASES)
def test_compiled_step_equals_the_eager_step(name):
    make, backend = CASES[name]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    twin = copy.deepcopy(net)
    compiled, before = train(make, backend, net)
    eager, _ = train(make, None, twin)
    assert compiled.skipped_steps == eager.skipped_steps == 1
    for (n, a), b, c in zip(net.named_parameters(), twin.parameters(), before):
        assert torch.equal(a, c), n  # the skipped step touched nothing
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    for p, q in zip(net.parameters(), twin.parameters()):
        for key, value in eager.state[q].items():
            torch.testing.assert_close(compiled.state[p][key], value, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
