"""Per-layer training diagnostics, trajectory smoothness, the descent lemma and the depth paper's step."""

import math

import pytest
import torch

from moga.optim import MOGA, Muon
from moga.smoothness import (
    BlockGeometry,
    RunningSmoothness,
    depth_paper_step,
    descent_residual,
    layer_diagnostics,
    probe,
    smoothness,
    trajectory_smoothness,
)

from .nets import MIXED_OVERRIDES, MixedNet, Quadratic, block_of, classification_loss, mixed_batch, quadratic_loss


def _train_step(model, opt, batch):
    opt.zero_grad()
    classification_loss(model, batch).backward()
    opt.step()


EXACT_OVERRIDES = {**MIXED_OVERRIDES, "head.weight": {"geometry": "spectral(method=svd)"}}


@pytest.mark.parametrize("make", [
    # the paper's preset: every group at one lr, the one the block comparison below is given
    lambda m: MOGA(m, lr=0.05, momentum=0.9, weight_decay=0.1, vectors="sign", overrides=EXACT_OVERRIDES,
                   preset="paper"),
    lambda m: Muon(m, lr=0.03, weight_decay=0.2, method="svd", vectors="sign", overrides={"experts": "hidden:boi"},
                   preset="moga"),  # every group a steepest-descent step
], ids=["moga", "muon-svd"])
def test_update_norm_is_lr_for_lmo_steps(make):
    torch.manual_seed(0)
    model = MixedNet()
    opt = make(model)
    block = BlockGeometry.from_optimizer(opt)
    _train_step(model, opt, mixed_batch(1))  # momentum buffers are not a plain gradient any more
    before = probe(model, classification_loss, mixed_batch(0), block.params)
    _train_step(model, opt, mixed_batch(0))
    after = probe(model, classification_loss, mixed_batch(0), block.params)
    rows = layer_diagnostics(opt, before.params, after.params, before.grads, grads_after=after.grads)
    assert [r["name"] for r in rows] == block.names
    for r in rows:
        assert r["update"] == "lmo"
        assert r["update_over_lr"] == pytest.approx(1.0, rel=1e-9), r["name"]  # weight decay taken out
        if r["role"] == "vector":  # vectors are never decayed (docs/integrations.md): the raw step is the update
            assert r["step_norm"] == pytest.approx(r["update_norm"], rel=1e-6)
        else:  # the decay is in the raw step
            assert r["step_norm"] != pytest.approx(r["update_norm"], rel=1e-6)
        assert r["grad_dual_norm"] > 0 and r["weight_norm"] > 0 and r["trajectory_smoothness"] > 0
    # Without the optimizer: a block, an explicit lr and weight decay give the same numbers.
    # (vectors' groups carry no decay, so they are compared at weight_decay=0)
    lr, wd = opt.param_groups[0]["lr"], max(g["weight_decay"] for g in opt.param_groups)
    same = layer_diagnostics(block, before.params, after.params, before.grads, lr=lr, weight_decay=wd)
    undecayed = layer_diagnostics(block, before.params, after.params, before.grads, lr=lr, weight_decay=0.0)
    expected = [(u if r["role"] == "vector" else s)["update_norm"] for s, u, r in zip(same, undecayed, rows)]
    assert expected == pytest.approx([r["update_norm"] for r in rows])
    # The block trajectory smoothness combines the layers: sum of dual norms over the max of norms.
    L = trajectory_smoothness(before.grads, after.grads, before.params, after.params, block)
    expected = sum(r["trajectory_smoothness"] * r["step_norm"] for r in rows) / max(r["step_norm"] for r in rows)
    assert L == pytest.approx(expected, rel=1e-9)


def test_adam_entries_are_measured_in_their_sign_geometry():
    torch.manual_seed(0)
    model = MixedNet()
    opt = MOGA(model, lr=0.05, overrides=MIXED_OVERRIDES)  # vectors="adamw": biases step with Adam
    block = BlockGeometry.from_optimizer(opt)
    before = block.snapshot()
    _train_step(model, opt, mixed_batch(0))
    rows = {r["name"]: r for r in layer_diagnostics(opt, before, block.snapshot(), block.grads())}
    assert rows["head.bias"]["update"] == "adam" and rows["head.bias"]["geometry"] == "vector"
    assert rows["head.bias"]["update_over_lr"] == pytest.approx(1.0, rel=1e-3)  # first Adam step ~ sign
    assert rows["hidden.weight"]["update_over_lr"] == pytest.approx(1.0, rel=1e-9)
    # Newton-Schulz only approximates the polar factor: its step's spectral norm is near lr, not at it.
    assert 0.6 < rows["head.weight"]["update_over_lr"] < 1.2


def test_quadratic_trajectory_and_descent_lemma():
    # f = 0.5 w^T A w: grad(W + D) - grad(W) = A D and the descent residual is exactly 0.5 D^T A D.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, generator=gen)
    A = a @ a.T
    model = Quadratic([(2, 3)], A)
    block = block_of(list(model.weights), ["sign"], ["oi"])
    L = smoothness(model, quadratic_loss, None, block, starts=8).value
    before = probe(model, quadratic_loss, None, block.params)
    with torch.no_grad():
        model.weights[0].add_(block.lmo(before.grads)[0], alpha=0.1)  # a sign-descent step of lr 0.1
    after = probe(model, quadratic_loss, None, block.params)
    delta = (after.params[0] - before.params[0]).reshape(-1)

    traj = trajectory_smoothness(before.grads, after.grads, before.params, after.params, block)
    assert block.norm([after.params[0] - before.params[0]]) == pytest.approx(0.1)
    assert traj == pytest.approx(float((A @ delta).abs().sum()) / 3 / 0.1)  # sign dual norm: ||.||_1 / n
    assert traj <= L * (1 + 1e-9)

    lemma = descent_residual(before.loss, after.loss, before.grads, before.params, after.params, block, L)
    assert lemma.residual == pytest.approx(0.5 * float(delta @ A @ delta), rel=1e-9)
    assert lemma.linear == pytest.approx(-0.1 * block.dual_norm(before.grads))
    assert lemma.curvature == pytest.approx(2 * lemma.residual / 0.1**2)
    # This step's sign pattern happens to be the maximizing vertex, so the lemma is tight to rounding.
    assert lemma.bound == pytest.approx(0.5 * L * 0.01) and lemma.residual <= lemma.bound * (1 + 1e-9)
    assert lemma.curvature <= L * (1 + 1e-9)


def test_depth_paper_step_and_running_smoothness():
    assert depth_paper_step(3.0, 6.0) == 0.5
    with pytest.raises(ValueError):
        depth_paper_step(1.0, 0.0)
    ema = RunningSmoothness("ema", beta=0.5)
    assert ema.step(1.0) is None
    for x in (4.0, math.nan, 2.0):
        ema.update(x)
    assert ema.value == 3.0 and ema.count == 2 and ema.step(6.0) == 2.0
    top = RunningSmoothness("max")
    for x in (1.0, 5.0, math.inf, 2.0):
        top.update(x)
    assert top.value == 5.0
