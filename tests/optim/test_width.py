"""One step moves a hidden layer's output by the same RMS at every width: the point of the mean-normalized
factors. A sign step without its 1/fan_in factor is the control that must fail the same check."""

import math

import pytest
import torch
from torch import nn

from moga.optim import MOGA, Muon, ScaledAdamW

OPTIMIZERS = {
    "moga-row-p2": lambda w: MOGA([w], lr=0.1, geometry="row(p=2)"),
    "moga-row-p1.5": lambda w: MOGA([w], lr=0.1, geometry="row(p=1.5)"),
    "moga-row-p2.5": lambda w: MOGA([w], lr=0.1, geometry="row(p=2.5)"),
    "moga-col-q2": lambda w: MOGA([w], lr=0.1, geometry="col(q=2)"),
    "moga-sign": lambda w: MOGA([w], lr=0.1, geometry="sign"),
    "adamw-scaled": lambda w: ScaledAdamW([w], lr=0.1),
    "muon": lambda w: Muon([w], lr=0.1, scale="mean", weight_decay=0.0),  # the geometry's factor
}
WIDTHS = [64, 256, 1024, 4096]


def output_change_rms(make_opt, width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = nn.Parameter(torch.randn(width, width, generator=gen) / math.sqrt(width))
    x = torch.randn(16, width, generator=gen)  # inputs with RMS 1 entries
    target = torch.randn(16, width, generator=gen)
    before = x @ w.detach().T
    loss = ((x @ w.T - target) ** 2).mean()
    loss.backward()
    opt = make_opt(w)
    opt.step()
    return ((x @ w.detach().T - before) ** 2).mean().sqrt().item()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_hidden_output_change_is_width_independent(name):
    widths = WIDTHS if name != "muon" else WIDTHS[:-1]  # Newton-Schulz at 4096^2 is slow on 2 cores
    rms = [output_change_rms(OPTIMIZERS[name], n) for n in widths]
    assert max(rms) / min(rms) < 1.3, dict(zip(widths, rms))
    assert 0.01 < rms[0] < 0.5  # O(lr), not vanishing


def test_published_muon_keeps_adamws_update_rms_so_its_output_change_grows_like_sqrt_width():
    """Moonlight's factor 0.2 sqrt(max(m, n)) fixes the step's entrywise RMS, as AdamW's is fixed: the output
    change then grows like sqrt(width) (docs/math.md §3.5), about 2x per 4x width."""
    rms = [output_change_rms(lambda w: Muon([w], lr=0.1, weight_decay=0.0), n) for n in WIDTHS[:3]]
    for a, b in zip(rms, rms[1:]):
        assert 1.5 < b / a < 2.5, rms


def test_control_unscaled_sign_step_grows_with_width():
    class UnscaledSign(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self):
            for p in self.param_groups[0]["params"]:
                p.add_(torch.sign(p.grad), alpha=-0.1)

    rms = [output_change_rms(lambda w: UnscaledSign([w]), n) for n in (64, 1024)]
    assert rms[1] / rms[0] > 10
