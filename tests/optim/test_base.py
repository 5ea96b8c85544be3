"""The optimizer shell: torch.optim conventions, the step rule, exact resume, bad input."""

import io
import math
import warnings

import pytest
import torch
from torch import nn

from moga.geometry import parse_geometry
from moga.optim import MOGA, GeometryOptimizer, Muon, ScaledAdamW

from .reference import ReferenceStep
from .tinynet import TINY_OVERRIDES, TinyNet, tiny_loss

FACTORIES = {
    "moga-row-p2": lambda m, **kw: MOGA(m, lr=0.05, overrides=TINY_OVERRIDES, **kw),
    "moga-row-p1.5-nesterov-wd": lambda m, **kw: MOGA(m, lr=0.05, p=1.5, nesterov=True, weight_decay=0.1,
                                                      overrides=TINY_OVERRIDES, **kw),
    "moga-row-p2.5-sign-vectors-plain": lambda m, **kw: MOGA(m, lr=0.05, p=2.5, vectors="sign", nesterov=False,
                                                             overrides=TINY_OVERRIDES, **kw),  # the papers' momentum
    "moga-col-q2": lambda m, **kw: MOGA(m, lr=0.05, geometries={"hidden": "col(q=2)", "readout": "col(q=2)"},
                                        overrides=TINY_OVERRIDES, **kw),
    "moga-sign": lambda m, **kw: MOGA(m, lr=0.05, geometries={"hidden": "sign", "conv": "sign"},
                                      overrides=TINY_OVERRIDES, **kw),
    "muon": lambda m, **kw: Muon(m, lr=0.05, weight_decay=0.01, overrides=TINY_OVERRIDES, **kw),
    # the row-family hybrids (docs/math.md §2.9); NorMuon's second moment is state that must resume and skip too
    "moga-row-spectral": lambda m, **kw: MOGA(m, lr=0.05, geometries={"hidden": "row_spectral"},
                                              overrides=TINY_OVERRIDES, **kw),
    "moga-spectral-row-beta2": lambda m, **kw: MOGA(m, lr=0.05, weight_decay=0.01,
                                                    geometries={"hidden": "spectral_row(beta2=0.95)"},
                                                    overrides=TINY_OVERRIDES, **kw),
    "adamw-scaled": lambda m, **kw: ScaledAdamW(m, lr=0.05, weight_decay=0.01, overrides=TINY_OVERRIDES, **kw),
}


def train(model, opt, steps, first_seed=0):
    for s in range(steps):
        model.zero_grad()
        tiny_loss(model, first_seed + s).backward()
        opt.step()


@pytest.mark.parametrize("name", FACTORIES)
def test_fast_path_equals_reference_path(name):
    torch.manual_seed(0)
    fast_model = TinyNet()
    ref_model = TinyNet()
    ref_model.load_state_dict(fast_model.state_dict())
    fast = FACTORIES[name](fast_model)
    ref = ReferenceStep(FACTORIES[name](ref_model).param_groups)
    train(fast_model, fast, 5)
    train(ref_model, ref, 5)
    for a, b in zip(fast_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", FACTORIES)
def test_resume_from_state_dict_is_bitwise(name, tmp_path):
    torch.manual_seed(0)
    straight = TinyNet()
    start = {k: v.clone() for k, v in straight.state_dict().items()}
    opt = FACTORIES[name](straight)
    train(straight, opt, 6)

    first = TinyNet()
    first.load_state_dict(start)
    opt = FACTORIES[name](first)
    train(first, opt, 3)
    torch.save({"model": first.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")

    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # plain data only
    resumed = TinyNet()
    resumed.load_state_dict(checkpoint["model"])
    opt = FACTORIES[name](resumed)
    opt.load_state_dict(checkpoint["optim"])
    train(resumed, opt, 3, first_seed=3)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_state_dict_is_keyed_by_index(tiny):
    opt = MOGA(tiny, overrides=TINY_OVERRIDES)
    train(tiny, opt, 1)
    state = opt.state_dict()
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert sorted(state["state"]) == list(range(n_params))
    assert all(isinstance(g["geometry"], str) for g in state["param_groups"])


def updates_of(model, opt, closure_seed=0):
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    tiny_loss(model, closure_seed).backward()
    opt.step()
    return {id(p): p.detach() - b for p, b in zip(model.parameters(), before)}


def test_each_layer_moves_by_exactly_lr_in_its_own_geometry(tiny):
    """The paper's step: every layer, tables included, a unit step of lr (MOGA's default scales the tables'
    lr, tests/optim/test_multipliers.py)."""
    opt = MOGA(tiny, lr=0.03, vectors="sign", overrides=TINY_OVERRIDES, preset="paper")
    deltas = updates_of(tiny, opt)
    for group in opt.param_groups:
        geometry = parse_geometry(group["geometry"])
        for p in group["params"]:
            layout = group["layout"] if geometry.matrix else None
            assert geometry.norm(deltas[id(p)], layout).item() == pytest.approx(0.03, rel=1e-5)


def test_weight_decay_is_decoupled(tiny):
    opt = MOGA(tiny, lr=0.1, momentum=0.0, weight_decay=0.5, vectors="sign", overrides=TINY_OVERRIDES,
               preset="paper")  # every group at lr 0.1 (decay with multipliers: test_multipliers.py)
    before = {id(p): p.detach().clone() for p in tiny.parameters()}
    opt.zero_grad()
    tiny_loss(tiny).backward()
    grads = {id(p): p.grad.clone() for p in tiny.parameters()}
    opt.step()
    for group in opt.param_groups:
        geometry = parse_geometry(group["geometry"])
        for p in group["params"]:
            layout = group["layout"] if geometry.matrix else None
            decay = 0.0 if group["role"] == "vector" else 0.5  # vectors are not decayed (one rule everywhere)
            assert group["weight_decay"] == decay
            expected = (1 - 0.1 * decay) * before[id(p)] + 0.1 * geometry.lmo(grads[id(p)], layout)
            torch.testing.assert_close(p.detach(), expected)
    # Raw param groups keep the weight decay they are given, vectors included.
    bias = tiny.hidden.bias
    opt = MOGA([{"params": [bias], "geometry": "vector"}], lr=0.1, weight_decay=0.5)
    assert opt.param_groups[0]["weight_decay"] == 0.5


def test_momentum_is_an_ema_and_nesterov_looks_ahead():
    w = nn.Parameter(torch.zeros(3, 4))
    g1, g2 = torch.randn(3, 4), torch.randn(3, 4)
    for nesterov in (False, True):
        w.data.zero_()
        opt = MOGA([w], lr=1.0, momentum=0.8, nesterov=nesterov, geometry="row(p=2)")
        for g in (g1, g2):
            w.grad = g.clone()
            before = w.detach().clone()
            opt.step()
        buf = 0.8 * (0.2 * g1) + 0.2 * g2
        direction = g2.lerp(buf, 0.8) if nesterov else buf
        torch.testing.assert_close(w.detach() - before, parse_geometry("row(p=2)").lmo(direction))


def test_closure_and_param_groups():
    a = nn.Parameter(torch.randn(4, 6))
    b = nn.Parameter(torch.randn(5))
    opt = MOGA([{"params": [a], "geometry": "col(q=2)"}], lr=0.1)
    opt.add_param_group({"params": [b], "geometry": "vector", "lr": 0.01})
    assert [g["geometry"] for g in opt.param_groups] == ["col(q=2)", "vector"]

    def closure():
        opt.zero_grad()
        loss = (a.sum() - 1) ** 2 + (b**2).sum()
        loss.backward()
        return loss

    b_before = b.detach().clone()
    loss = opt.step(closure)
    assert loss.item() > 0
    assert (b.detach() - b_before).abs().max().item() == pytest.approx(0.01)


def test_schedulers_drive_the_step_size(tiny):
    opt = MOGA(tiny, lr=0.1, vectors="sign", overrides=TINY_OVERRIDES)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=0.01)
    hidden = next(g for g in opt.param_groups if g["role"] == "hidden" and g["layout"] == "oi")
    geometry = parse_geometry(hidden["geometry"])
    for step in range(4):
        lr = opt.param_groups[0]["lr"]
        assert lr == pytest.approx(0.01 + 0.09 * (1 + math.cos(math.pi * step / 4)) / 2)
        deltas = updates_of(tiny, opt, step)
        assert geometry.norm(deltas[id(hidden["params"][0])]).item() == pytest.approx(lr, rel=1e-5)
        sched.step()


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda m: MOGA(m, lr=-1.0), "lr must be >= 0"),
        (lambda m: MOGA(m, lr=float("nan")), "lr must be a finite number"),
        (lambda m: MOGA(m, momentum=1.0), "momentum must be in"),
        (lambda m: MOGA(m, momentum=-0.1), "momentum must be in"),
        (lambda m: MOGA(m, p=0.5), ">= 1"),
        (lambda m: MOGA(m, embedding_q=float("nan")), ">= 1"),
        (lambda m: MOGA(m, weight_decay=-1e-3), "weight_decay"),
        (lambda m: MOGA(m, betas=(0.9, 1.0)), "betas"),
        (lambda m: MOGA(m, eps=0.0), "eps"),
        (lambda m: MOGA(m, vectors="lion"), "vectors must be one of"),
        (lambda m: MOGA(m, nonfinite="panic"), "nonfinite must be one of"),
        (lambda m: MOGA(m, kernel="fast"), "kernel must be one of"),
        (lambda m: MOGA(m, geometries={"hiden": "row(p=2)"}), "unknown role"),
        (lambda m: MOGA(m, geometries={"hidden": "spectral(scale=wide)"}), "scale must be"),
        (lambda m: MOGA(m.parameters()), r"^MOGA gives each parameter .*: pass the model, MOGA\(model\) \(in Hugging "
                                         r"Face's Trainer: optimizer_cls_and_kwargs=\(MOGA, \{'model': model, [^\n]*$"),
        (lambda m: Muon(m.parameters()), r"params\[0\] of shape \(2, 12, 12\): .*'boi' .*; or pass the model itself"),
        (lambda m: Muon([m.hidden.bias]), r"params\[0\] of shape \(12,\): the matrix geometry spectral.* pass the model"),
        (lambda m: MOGA([m.experts], geometry="row(p=2)"), "layout="),
        (lambda m: ScaledAdamW([m.hidden.weight], geometries={"hidden": "row(p=2)"}), "pass the nn.Module"),
        (lambda m: GeometryOptimizer([m.hidden.weight], lr=0.1, geometry="row(p=2)", update="adam"), "sign geometry"),
    ],
)
def test_bad_hyperparameters_are_clear_errors(tiny, make, match):
    with pytest.raises(ValueError, match=match):
        make(tiny)


@pytest.mark.parametrize("name", FACTORIES)
def test_nonfinite_gradients_skip_the_step_and_touch_nothing(name, tiny):
    opt = FACTORIES[name](tiny)
    train(tiny, opt, 2)
    params = [p.detach().clone() for p in tiny.parameters()]
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
    opt.zero_grad()
    tiny_loss(tiny).backward()
    tiny.hidden.weight.grad[0, 0] = float("nan")
    tiny.embed.weight.grad[1, 1] = float("inf")
    opt.step()  # decided on the device: no warning, which would need a host sync
    assert opt.skipped_steps == 1
    for a, b in zip(tiny.parameters(), params):
        assert torch.equal(a, b)
    for k, s in opt.state_dict()["state"].items():
        for n, v in s.items():
            assert torch.equal(v, state[k][n])
    assert opt.state_dict()["skipped_steps"] == 1


def test_nonfinite_gradients_can_raise(tiny):
    opt = MOGA(tiny, nonfinite="raise", overrides=TINY_OVERRIDES)
    before = [p.detach().clone() for p in tiny.parameters()]
    opt.zero_grad()
    tiny_loss(tiny).backward()
    tiny.head.weight.grad.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="head.weight"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), before))


def test_skipped_steps_survive_a_resume(tiny):
    opt = MOGA(tiny, overrides=TINY_OVERRIDES)
    opt.zero_grad()
    tiny_loss(tiny).backward()
    tiny.head.bias.grad.fill_(float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    fresh = MOGA(tiny, overrides=TINY_OVERRIDES)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.skipped_steps == 1


def test_weight_decay_past_one_over_lr_warns_at_construction():
    """W <- (1 - lr*wd) W: at lr*wd = 3 the weights are multiplied by -2 each step and reach inf."""
    from moga.optim.registry import OPTIMIZERS

    def model():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))

    for build in (lambda m: MOGA(m, lr=1.0, weight_decay=3.0), lambda m: Muon(m, lr=1.0, weight_decay=3.0),
                  lambda m: ScaledAdamW(m, lr=1.0, weight_decay=3.0),
                  lambda m: OPTIMIZERS["adamw"].build(m, lr=1.0, weight_decay=3.0),
                  lambda m: OPTIMIZERS["sgd"].build(m, lr=1.0, weight_decay=3.0)):
        with pytest.warns(UserWarning, match=r"lr x weight_decay = 3 > 1: .* \(1 - lr\*wd\) = -2, .* to inf"):
            build(model())
    with pytest.warns(UserWarning, match=r"= 1.5 > 1: .* flipping their sign\. "):
        MOGA(model(), lr=0.5, weight_decay=3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MOGA(model(), lr=0.5, weight_decay=1.9)
        OPTIMIZERS["adamw"].build(model(), lr=1e-3, weight_decay=0.1)
    m = model()  # what the warning is about: 20 steps of torch's AdamW at lr*wd = 3
    with pytest.warns(UserWarning):
        opt = OPTIMIZERS["adamw"].build(m, lr=1.0, weight_decay=3.0)
    for _ in range(20):
        opt.zero_grad()
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert m[0].weight.abs().max() > 1e5


def test_groups_added_or_state_loaded_after_steps_step_as_a_fresh_optimizer():
    """Nothing the step keeps between steps goes stale: a group added after a step, and a state dict loaded
    into an optimizer that stepped (beside one with other geometries on the same shapes), step bit for bit as
    a fresh optimizer with the same history does."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in ((8, 6), (8, 6), (6, 10))]
    grads = [[torch.randn(v.shape, generator=gen) * 1e-2 for v in values] for _ in range(3)]
    specs = ("row(p=2)", "row(p=1.5)", "col(q=2)")

    def run(late: bool, steps: int = 3):
        ps = [nn.Parameter(v.clone()) for v in values]
        groups = [{"params": [p], "geometry": s} for p, s in zip(ps, specs)]
        opt = MOGA(groups[:1] if late else groups, lr=0.1, nesterov=True, weight_decay=0.1)
        for s in range(steps):
            if late and s == 1:
                for group in groups[1:]:
                    opt.add_param_group(group)
            for k, p in enumerate(ps):
                p.grad = grads[s][k].clone() if k == 0 or s >= 1 else None
            opt.step()
        return ps, opt

    fresh, fresh_opt = run(late=False)
    late, _ = run(late=True)
    for a, b in zip(fresh, late):
        assert torch.equal(a, b)

    # An optimizer that stepped (beside another that stepped p=3 and col on the same shapes) loads the fresh
    # one's state after two steps, and takes the third step as the fresh one did.
    _, saved = run(late=False, steps=2)
    for specs_now in (("row(p=3)", "col(q=2)", "row(p=2)"), specs):
        other = [nn.Parameter(v.clone() + 1) for v in values]
        loaded = MOGA([{"params": [p], "geometry": s} for p, s in zip(other, specs_now)], lr=0.1, nesterov=True,
                      weight_decay=0.1)
        for p, g in zip(other, grads[0]):
            p.grad = g.clone()
        loaded.step()
    loaded.load_state_dict(saved.state_dict())
    with torch.no_grad():
        for p, q in zip(other, saved.param_groups):
            p.copy_(q["params"][0])
    for p, g in zip(other, grads[2]):
        p.grad = g.clone()
    loaded.step()
    for a, b in zip(fresh, other):
        assert torch.equal(a, b)
