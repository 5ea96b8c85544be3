"""Muon against torch.optim.Muon, and the geometry's own scale."""

import math

import pytest
import torch
from torch import nn

from moga.optim import Muon
from moga.orthogonalize import newton_schulz


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
