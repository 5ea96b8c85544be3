"""16-bit parameters: float32 math and state, optional float32 master weights, bfloat16 state."""

import io

import pytest
import torch
from torch import nn

from moga.hardware import assume
from moga.optim import MOGA, Muon, ScaledAdamW
from moga.orthogonalize import compute_dtype


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.embed = nn.Embedding(20, width)
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, 20)

    def forward(self, tokens):
        return self.head(torch.relu(self.hidden(self.norm(self.embed(tokens)))))


def step_once(model, opt, seed=0):
    tokens = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(seed))
    model.zero_grad()
    nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten()).backward()
    opt.step()


def model_in(dtype):
    torch.manual_seed(0)
    return Block().to(dtype)


@pytest.mark.parametrize("make, bf16_units", [(MOGA, False), (Muon, False), (Muon, True), (ScaledAdamW, False)],
                         ids=["moga", "muon", "muon-bf16-units", "adamw-scaled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_parameters_step_in_float32(make, bf16_units, dtype):
    """float16 used to turn a LayerNorm bias inf in one step (Adam's eps underflows in float16). Muon's
    Newton-Schulz runs in bfloat16 on CPUs with bf16 units (both branches here, on any CPU): the bound
    follows the roundoff of the parameters' dtype and of the Newton-Schulz dtype actually used."""
    with assume(bf16_matmul=bf16_units):
        model, ref = model_in(dtype), model_in(torch.float32)
        ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        opt, ref_opt = make(model), make(ref)
        for seed in range(3):
            step_once(model, opt, seed)
            step_once(ref, ref_opt, seed)
        ns_dtype = compute_dtype("auto", torch.device("cpu")) if make is Muon else torch.float32
    assert ns_dtype == (torch.bfloat16 if make is Muon and bf16_units else torch.float32)
    roundoff = torch.finfo(dtype).eps + torch.finfo(ns_dtype).eps
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.float() - r).norm() <= 3 * roundoff * r.norm() + 1e-3, name


def test_state_dtype_bfloat16_halves_the_moments():
    model = model_in(torch.float32)
    opt = MOGA(model, state_dtype="bfloat16")
    step_once(model, opt)
    kinds = {k: v.dtype for s in opt.state.values() for k, v in s.items()}
    assert kinds["momentum_buffer"] == kinds["exp_avg"] == kinds["exp_avg_sq"] == torch.bfloat16
    with pytest.raises(ValueError, match="state_dtype"):
        MOGA(model, state_dtype=torch.float16)


def test_master_weights_accumulate_steps_below_bfloat16_precision():
    """One bf16 step without a master copy loses most of a small update to rounding; the float32 master
    keeps it (GPT-2-small shapes: the numbers in GeometryOptimizer's docstring)."""
    w0 = (torch.randn(64, 256) * 0.02).bfloat16()
    g = torch.randn(64, 256) * 1e-3
    updates = {}
    for label, dtype, kw in [("fp32", torch.float32, {}), ("bf16", torch.bfloat16, {}),
                             ("master", torch.bfloat16, {"master_weights": True})]:
        p = nn.Parameter(w0.to(dtype).clone())  # w0 itself stays the start
        opt = MOGA([p], lr=2**-5, geometry="row(p=2)", **kw)
        p.grad = g.to(dtype)
        opt.step()
        after = opt.state[p]["master"] if kw else p.detach().float()
        updates[label] = after - w0.float()
    error = {k: ((u - updates["fp32"]).norm() / updates["fp32"].norm()).item() for k, u in updates.items()}
    assert error["master"] < 5e-3, error
    assert error["bf16"] > 0.1, error


def test_master_weights_and_bfloat16_state_survive_a_resume():
    straight, first = model_in(torch.bfloat16), model_in(torch.bfloat16)
    make = lambda m: MOGA(m, master_weights=True, state_dtype=torch.bfloat16)  # noqa: E731
    opt = make(straight)
    for seed in range(4):
        step_once(straight, opt, seed)
    opt = make(first)
    for seed in range(2):
        step_once(first, opt, seed)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt = make(first)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    dtypes = {k: v.dtype for s in opt.state.values() for k, v in s.items()}
    assert dtypes["master"] == torch.float32 and dtypes["momentum_buffer"] == torch.bfloat16
    for seed in range(2, 4):
        step_once(first, opt, seed)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), first.parameters()))
