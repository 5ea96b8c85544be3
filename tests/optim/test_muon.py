"""Muon against torch.optim.Muon, and the geometry's own scale."""

import math

import pytest
import torch
from torch import nn

from moga.optim import Muon
from moga.orthogonalize import DEFAULT_NS_STEPS, newton_schulz


def quadratic_grads(params, targets):
    loss = sum(((p @ t) ** 2).sum() for p, t in zip(params, targets))
    loss.backward()


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_bit_for_bit(nesterov):
    torch.manual_seed(0)
    shapes = [(32, 32), (16, 48), (48, 16)]
    ours = [nn.Parameter(torch.randn(s) / math.sqrt(s[1])) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    targets = [torch.randn(s[1], 8) for s in shapes]
    opt = Muon(ours, lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=0.1, scale="torch", ns_dtype="bfloat16")
    ref = torch.optim.Muon(theirs, lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=0.1)
    for _ in range(10):
        for o, params in ((opt, ours), (ref, theirs)):
            o.zero_grad()
            quadratic_grads(params, targets)
            o.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)  # the same operations in the same dtype: bit for bit


def test_mean_scale_is_sqrt_fan_out_over_fan_in():
    for m, n in [(64, 16), (16, 64)]:
        w = nn.Parameter(torch.zeros(m, n))
        w.grad = torch.randn(m, n)
        Muon([w], lr=1.0, momentum=0.0, nesterov=False, ns_dtype="float32").step()
        expected = -math.sqrt(m / n) * newton_schulz(w.grad, dtype=torch.float32)
        torch.testing.assert_close(w.detach(), expected)


def test_muon_plan_uses_spectral_on_matrices_only():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    opt = Muon(model)
    roles = {e.role: e.geometry for e in opt.plan}
    assert roles["hidden"].startswith("spectral") and roles["readout"].startswith("spectral")
    assert roles["embedding"] == "embedding(q=2)"
    assert roles["vector"] == "vector"


def test_same_shape_matrices_share_one_batched_newton_schulz():
    torch.manual_seed(0)
    shapes = [(24, 24)] * 4 + [(48, 24)] * 2 + [(24, 48)]
    params = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    singles = [nn.Parameter(p.detach().clone()) for p in params]
    batched = Muon(params, lr=0.02, nesterov=True, weight_decay=0.1, ns_dtype="float64")
    one_by_one = [Muon([p], lr=0.02, nesterov=True, weight_decay=0.1, ns_dtype="float64") for p in singles]
    for _ in range(2):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for p, q, g in zip(params, singles, grads):
            p.grad, q.grad = g.clone(), g.clone()
        with torch.profiler.profile() as prof:
            batched.step()
        for o in one_by_one:
            o.step()
        for p, q in zip(params, singles):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    calls = {e.key: e.count for e in prof.key_averages()}
    steps = DEFAULT_NS_STEPS
    # one batched iteration per shape (3), not per matrix (7): 2 matmul-adds per Newton-Schulz step each
    assert calls.get("aten::baddbmm") == 3 * 2 * steps
