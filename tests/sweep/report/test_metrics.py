import json
import math

import numpy as np
import pytest

from moga.sweep.report import analyze
from moga.sweep.report.curves import make_grid, parabola_vertex

from .synthetic import parabola_sweep, pow2

SCALES = (2, 4, 8, 16, 32)


def one(records, **kw):
    (panel,) = analyze(records, resamples=200, **kw)
    return panel


def test_optimum_moving_one_grid_step_per_doubling():
    p = one(parabola_sweep([-3, -4, -5, -6, -7]))
    assert [c.best_lr for c in p.curves] == [2.0**k for k in (-3, -4, -5, -6, -7)]
    assert [c.refined_log2_lr for c in p.curves] == pytest.approx([-3, -4, -5, -6, -7], abs=1e-9)
    assert p.drift.steps == 4 and p.drift.log2_grid == 4.0
    assert p.drift.log2_refined == pytest.approx(4.0)
    assert p.drift.slope_per_doubling == pytest.approx(-1.0)
    assert p.verdict == "does not transfer"
    # reusing K=2's 2^-3 at K=32 (optimum 2^-7): 0.05 * 4^2 above a floor of 0.3
    worst = p.worst_regret
    assert worst.scale == 32 and worst.absolute == pytest.approx(0.8) and worst.relative == pytest.approx(0.8 / 0.3)
    assert p.verdict_line == ("does not transfer: reusing the reference's optimum costs 266.7% [266.7%, 266.7%] "
                              "at K=32, above the 2% cap with 95% confidence")
    assert [s.drift_steps for s in p.decision.scales] == pytest.approx([0, -1, -2, -3, -4])


def test_off_grid_optimum_is_refined_exactly_and_transfers():
    p = one(parabola_sweep([-4.3] * 5))
    assert all(c.best_lr == 2.0**-4 for c in p.curves)
    assert [c.refined_log2_lr for c in p.curves] == pytest.approx([-4.3] * 5, abs=1e-9)
    assert p.drift.steps == 0 and p.drift.slope_per_doubling == pytest.approx(0.0, abs=1e-9)
    assert p.verdict == "transfers"
    assert p.verdict_line.startswith("transfers: drift within 0.00 steps (limit 1) and regret at most 0.0% (cap 2%)")


def test_one_grid_step_of_drift_with_a_large_regret_does_not_transfer():
    floors = [0.5, 0.45, 0.4, 0.35, 0.3]
    p = one(parabola_sweep([-4, -4, -4, -5, -5], floors=floors))
    assert p.drift.steps == 1
    regrets = {r.scale: r for r in p.regrets}
    assert regrets[2].status == "reference"
    assert regrets[8].absolute == pytest.approx(0.0)
    assert regrets[32].absolute == pytest.approx(0.05) and regrets[32].relative == pytest.approx(0.05 / 0.3)
    assert p.verdict == "does not transfer"
    assert p.verdict_line == ("does not transfer: reusing the reference's optimum costs 16.7% [16.7%, 16.7%] at K=32, "
                              "above the 2% cap with 95% confidence")
    # the threshold is the user's: at 20% the same panel transfers, and says what it costs
    loose = one(parabola_sweep([-4, -4, -4, -5, -5], floors=floors), max_regret=0.2)
    assert loose.verdict == "transfers" and loose.verdict_line.startswith(
        "transfers: drift within 1.00 steps (limit 1) and regret at most 16.7% (cap 20%)")
    assert "at most 20%" in loose.criterion


def test_a_panel_with_28_percent_regret_never_transfers():
    """One grid step of drift, no divergence, but the small model's rate costs 28% at the largest depth."""
    floors = [0.5, 0.5, 0.5, 0.5, 0.25]
    rows = parabola_sweep([-4, -4, -4, -4, -5], floors=floors, curvature=0.07)
    p = one(rows)
    assert p.drift.steps == 1 and p.worst_regret.relative == pytest.approx(0.28)
    assert p.verdict == "does not transfer" and "28.0%" in p.verdict_line
    for max_drift_steps in (1, 2, 5):  # no drift allowance makes it transfer
        assert one(rows, max_drift_steps=max_drift_steps).verdict != "transfers"


def test_small_regret_transfers():
    floors = [0.5, 0.5, 0.5, 0.5, 5.0]  # 0.05 * 1 / 5.0: 1% regret
    p = one(parabola_sweep([-4, -4, -4, -4, -5], floors=floors))
    assert p.drift.steps == 1 and p.worst_regret.relative == pytest.approx(0.01)
    assert p.verdict == "transfers"


def test_parabola_vertex_any_spacing():
    x = np.array([-5.0, -4.0, -1.5])
    y = 2.0 + 0.7 * (x + 3.2) ** 2
    assert parabola_vertex(*x, *y) == pytest.approx(-3.2)
    assert np.isnan(parabola_vertex(0.0, 1.0, 2.0, 1.0, 1.0, 1.0))  # flat: no vertex


def test_grid_regularity():
    assert make_grid(pow2(-6, 0)).regular and make_grid(pow2(-6, 0)).step_log2 == 1.0
    assert make_grid([1e-3, 3e-3, 1e-2, 3e-2, 1e-1]).regular  # 1-3-10 grids are log-spaced enough
    assert not make_grid([1e-3, 2e-3, 1e-2, 2e-2, 1e-1]).regular


def test_irregular_grid_falls_back_to_log2_units():
    lrs = [1e-3, 2e-3, 1e-2, 2e-2, 1e-1, 2e-1]
    moved = one(parabola_sweep([math.log2(2e-2), math.log2(2e-3)], scales=(2, 4), lrs=lrs))
    assert moved.drift.steps is None and moved.drift.log2_grid == pytest.approx(math.log2(10))
    assert moved.verdict == "does not transfer"
    assert moved.decision.scales[1].drift_steps == pytest.approx(-math.log2(10))  # log2 units on this grid
    assert any("not log-spaced" in n for n in moved.notes)
    stays = one(parabola_sweep([math.log2(1e-2)] * 2, scales=(2, 4), lrs=lrs))
    assert stays.verdict == "transfers" and "drift within 0.00 steps" in stays.verdict_line


def test_each_optimizer_has_its_own_grid():
    fine = [2.0 ** (k / 2) for k in range(-16, 1)]  # half-octave grid
    records = (parabola_sweep([-4, -5], scales=(2, 4), lrs=fine, optimizer="moga")
               + parabola_sweep([-10, -10], scales=(2, 4), lrs=pow2(-14, -6), optimizer="adamw"))
    moga, adamw = analyze(records, resamples=50)
    assert moga.grid.step_log2 == 0.5 and moga.drift.steps == 2 and moga.drift.log2_grid == 1.0
    assert moga.verdict == "does not transfer"
    assert adamw.grid.lrs == pow2(-14, -6) and adamw.drift.steps == 0 and adamw.verdict == "transfers"


def test_lower_edge_gives_no_verdict_and_says_where_to_extend():
    high = [30.0] * 3  # a high floor keeps the regret (a lower bound at the edge) under 2%
    p = one(parabola_sweep([-5, -5, -7], scales=(2, 4, 8), lrs=pow2(-6, 0), floors=high))
    edge = p.curves[-1]
    assert edge.status == "edge" and edge.edge == "lower" and edge.best_lr == 2.0**-6
    assert p.verdict == "no verdict"
    assert p.verdict_line == ("no verdict: K=8's optimum is at the lower edge of its lr grid (lr=2^-6), "
                              "extend the grid below it")
    assert p.drift.scales == [2, 4] and p.drift.steps_at_least == 1
    # a large regret at the edge does not decide either: the edge's optimum, and so the regret, are bounds only
    costly = one(parabola_sweep([-5, -5, -7], scales=(2, 4, 8), lrs=pow2(-6, 0)))
    assert costly.verdict == "no verdict" and costly.decision is None


def test_upper_edge():
    p = one(parabola_sweep([-1, -1, 1], scales=(2, 4, 8), lrs=pow2(-6, 0), floors=[30.0] * 3))
    assert p.curves[-1].edge == "upper" and p.verdict == "no verdict"
    assert "extend the grid above it" in p.verdict_line
    far = one(parabola_sweep([-2, -2, 1], scales=(2, 4, 8), lrs=pow2(-6, 0)))
    assert far.verdict_line.startswith("does not transfer: the optimum moves at least 2 grid steps from K=2 to K=8 "
                                       "(best lr rises at least 4x; K=8 off the grid; read from the grid edges, "
                                       "no interval), worst regret >= ")


def test_edge_far_from_the_others_is_still_no_transfer():
    p = one(parabola_sweep([-4, -4, -4, -4, -12]))  # K=32's optimum is below the grid (2^-10 .. 2^0)
    assert p.curves[-1].edge == "lower"
    assert p.drift.steps_at_least == 6
    assert p.verdict == "does not transfer"
    assert "moves at least 6 grid steps" in p.verdict_line and "K=32 off the grid" in p.verdict_line


def test_diverged_points_are_kept_and_regret_diverges():
    p = one(parabola_sweep([-3, -4, -5, -6, -7], diverge_above=2.5))
    k32 = p.curves[-1]
    assert math.isinf(k32.loss[k32.lrs.index(2.0**-3)])  # kept on the curve as diverged
    assert k32.n_diverged[-1] == 3  # every seed
    regrets = {r.scale: r for r in p.regrets}
    assert regrets[32].status == "diverges" and math.isinf(regrets[32].relative)
    assert regrets[8].status == "ok"
    assert p.verdict == "does not transfer"
    assert p.verdict_line == "does not transfer: reusing the reference's optimum diverges at K=16"
    json.dumps(p.to_dict(), allow_nan=False)


def test_refinement_needs_finite_neighbours_and_three_points():
    rows = parabola_sweep([-4, -4], scales=(2, 4), lrs=pow2(-6, -2), diverge_above=0.5)
    p = one(rows)
    assert p.curves[0].refinement == "a neighbour of the optimum diverged: not refined"
    assert p.curves[0].refined_lr == p.curves[0].best_lr
    few = one(parabola_sweep([-4, -4], scales=(2, 4), lrs=pow2(-5, -3), diverge_above=0.5))
    assert few.curves[0].refinement == "fewer than 3 finite points: not refined"
    assert any("fewer than 3 finite points" in n for n in few.notes)


def test_ties_go_to_the_smaller_lr():
    rows = parabola_sweep([-4, -4], scales=(2, 4), lrs=pow2(-6, -2))
    for r in rows:
        if r["lr"] in (2.0**-4, 2.0**-3):
            r["train_loss"] = 0.3
    p = one(rows)
    assert all(c.best_lr == 2.0**-4 for c in p.curves)


def test_a_diverged_seed_makes_its_point_diverged():
    rows = parabola_sweep([-4, -4], scales=(2, 4), seeds=(0, 1, 2))
    bad = next(r for r in rows if r["scale"] == 4 and r["lr"] == 2.0**-2 and r["seed"] == 1)
    bad.update(status="diverged", train_loss=math.inf)
    p = one(rows)
    c = p.curves[1]
    j = c.lrs.index(2.0**-2)
    assert math.isinf(c.loss[j]) and (c.n_seeds[j], c.n_diverged[j]) == (3, 1)
    assert "K=4, lr=2^-2: 1 of 3 seeds diverged (counted as diverged)" in p.notes


def test_bootstrap_over_seeds():
    offsets = {0: 0.0, 1: 0.01, 2: -0.01}
    exact = one(parabola_sweep([-4, -5, -6], scales=(2, 4, 8), seeds=(0, 1, 2), seed_offsets=offsets))
    b = exact.bootstrap
    assert b.seeds == {2: 3, 4: 3, 8: 3}
    assert b.refined_log2_lr[8] == pytest.approx((-6, -6))  # offsets do not move an optimum
    assert b.slope_per_doubling == pytest.approx((-1, -1)) and b.drift_steps == (2, 2)
    assert b.share_within_criterion == 0.0

    rng = np.random.default_rng(1)
    rows = parabola_sweep([-4, -4, -4], scales=(2, 4, 8), seeds=range(5))
    for r in rows:
        r["train_loss"] += 0.02 * rng.standard_normal()
    noisy, again = one(rows), one(rows)
    lo, hi = noisy.bootstrap.drift_log2_refined
    assert lo <= noisy.drift.log2_refined <= hi
    assert noisy.bootstrap == again.bootstrap  # seeded: the same records give the same intervals
    assert {c.scale: set(c.seed_best_lrs) for c in noisy.curves} == {s: set(range(5)) for s in (2, 4, 8)}
    assert one(parabola_sweep([-4, -4], scales=(2, 4), seeds=(0,))).bootstrap is None  # one seed: nothing to resample


def test_statuses_failed_is_missing_skipped_is_diverged():
    rows = parabola_sweep([-4, -4], scales=(2, 4), lrs=pow2(-6, 0))
    for r in rows:
        if r["scale"] == 4 and r["lr"] == 2.0**-6:
            r.update(status="failed", train_loss=None)
        if r["scale"] == 4 and r["lr"] == 1.0:
            r.update(status="skipped")
    c = one(rows).curves[1]
    assert 2.0**-6 not in c.lrs and math.isinf(c.loss[c.lrs.index(1.0)])


def test_single_scale_and_all_diverged():
    assert one(parabola_sweep([-4], scales=(8,))).verdict_line == "no verdict: only one scale (K=8)"
    p = one(parabola_sweep([-5, -12], scales=(2, 4), lrs=pow2(-6, 0), diverge_above=1))
    assert p.curves[1].status == "all diverged" and p.regrets[1].status == "no optimum"
    assert p.verdict_line == "no verdict: K=4 diverged at every lr, extend the grid below lr=2^-6"
    far = one(parabola_sweep([-3, -12], scales=(2, 4), lrs=pow2(-6, 0), diverge_above=1))
    assert far.verdict_line == ("does not transfer: the optimum moves at least 3 grid steps from K=2 to K=4 "
                                "(best lr falls at least 8x; K=4 diverged at every lr; read from the grid edges, "
                                "no interval), "
                                "regret not measured (K=4 has no finite loss)")


def test_grouping_scale_keys_and_runner_rows():
    rows = parabola_sweep([-4, -4], scales=(2, 4), batch=32) + parabola_sweep([-4, -4], scales=(2, 4), batch=64)
    with pytest.raises(ValueError, match="group_keys"):
        analyze(rows)
    assert len(analyze(rows, group_keys=("optimizer", "scaling", "batch"), resamples=0)) == 2

    width = parabola_sweep([-4, -5], scales=(256, 512), scale_key="width")
    depth = parabola_sweep([-4, -4], scales=(2, 4))
    with pytest.raises(ValueError, match="several scale keys"):
        analyze(depth + width)
    (p,) = analyze(depth + width, scale_key="width")
    assert p.verdict_line == ("does not transfer: reusing the reference's optimum costs 16.7% [16.7%, 16.7%] at "
                              "width 512, above the 2% cap with 95% confidence")

    runner = [{"optim.name": "muon", "model.depth_scaling": "none", "model.depth": r["scale"], "optim.lr": r["lr"],
               "seed": r["seed"], "status": r["status"], "train_loss": r["train_loss"], "cell": "abc"}
              for r in parabola_sweep([-4, -4], scales=(2, 4))]
    (p,) = analyze(runner, scale_key="model.depth")
    assert p.panel == {"optimizer": "muon", "scaling": "none"} and p.title == "muon, none (alpha=1)"
    assert p.verdict == "transfers" and "worst at K=4" in p.verdict_line


def test_a_reused_rate_that_diverges_does_not_transfer():
    """Optima one step apart, but the smallest model's best rate diverges at the largest depth."""
    from moga.sweep.report import analyze

    rows = []
    for depth, best in ((2, -5), (32, -6)):
        for k in range(-9, -3):
            for seed in range(3):
                loss = math.inf if (depth == 32 and k >= -5) else 0.3 + 0.01 * (k - best) ** 2 + 0.001 * seed
                rows.append({"optimizer": "muon", "scaling": "none", "scale": depth, "lr": 2.0**k, "seed": seed,
                             "status": "diverged" if math.isinf(loss) else "finished", "train_loss": loss})
    (summary,) = analyze(rows, scale_key="depth")
    assert summary.verdict == "does not transfer"
    assert summary.verdict_line == "does not transfer: reusing the reference's optimum diverges at K=32"
    one_seed = [r for r in rows if r["seed"] == 0]  # the same with one seed: an anecdote
    assert analyze(one_seed, scale_key="depth")[0].verdict == "inconclusive"


def test_a_mapping_valued_key_makes_panels_like_any_other():
    """`moga sweep --seeds --by optim.overrides`: a per-name geometry override is a dict, and a panel value."""
    attention = {"*.attn.*.weight": {"geometry": "spectral"}}
    rows = (parabola_sweep([-5, -5, -5], scales=(2, 4, 8), overrides=None)
            + parabola_sweep([-3, -3, -3], scales=(2, 4, 8), overrides=attention))
    panels = analyze(rows, group_keys=("optimizer", "overrides"))
    assert [p.panel["overrides"] for p in panels] == [None, attention]
    assert [p.reference_lr for p in panels] == [2.0**-5, 2.0**-3]
