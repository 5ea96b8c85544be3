"""The noise-aware transfer decision on synthetic curves whose optima, regrets and seed noise are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moga.sweep.report.curves import build_curve, make_grid
from moga.sweep.report.decision import decide_transfer, fit, resample_means, widening
from moga.sweep.report.schema import parse_records

LRS = [2.0**k for k in range(-9, 0)]


def noisy_curves(optima, step_cost, noise_sd, seeds, rng, floor=1.0, scales=(2, 8, 32)):
    """Curves of loss = floor * (1 + step_cost * (log2 lr - optimum)^2) * (1 + noise), noise ~ N(0, sd)
    per run; one curve per scale."""
    rows = []
    for scale, opt in zip(scales, optima):
        for lr in LRS:
            for seed in range(seeds):
                x = math.log2(lr)
                loss = floor * (1 + step_cost * (x - opt) ** 2) * (1 + noise_sd * rng.standard_normal())
                rows.append({"optimizer": "moga", "scale": scale, "lr": lr, "seed": seed, "train_loss": loss})
    records = parse_records(rows)
    grid = make_grid(LRS)
    return [build_curve(s, [r for r in records if r.scale == s], "train_loss", grid) for s in scales], grid


def decide(curves, grid, **kw):
    return decide_transfer(curves, grid.step_log2, resamples=400, **kw)


def test_fit_recovers_an_off_grid_optimum_and_reads_the_regret_off_the_parabola():
    x = np.log2(LRS)
    y = 1.0 + 0.05 * (x + 4.3) ** 2
    f = fit(x, y[None, :])
    assert f.optimum[0] == pytest.approx(-4.3) and f.minimum[0] == pytest.approx(1.0)
    assert f.at(np.array([-4.0]))[0] == pytest.approx(1 + 0.05 * 0.09)  # inside the fitted neighbourhood
    far = f.at(np.array([-7.5]))[0]  # outside: the straight line between -8 and -7
    assert far == pytest.approx((1 + 0.05 * 3.7**2 + 1 + 0.05 * 2.7**2) / 2)
    assert math.isnan(f.at(np.array([0.5]))[0])  # beyond the grid: not measured


def test_a_diverged_neighbour_makes_the_segment_diverge():
    x = np.log2(LRS)
    y = 1.0 + 0.05 * (x + 4) ** 2
    y[6:] = np.inf
    f = fit(x, y[None, :])
    assert math.isinf(f.at(np.array([x[5] + 0.5]))[0]) and math.isfinite(f.at(np.array([x[5]]))[0])


def test_widened_resampled_means_cover_the_true_mean_like_students_t():
    """With 3 seeds the plug-in bootstrap covers about 75% of the time; the widened one about 95%."""
    rng = np.random.default_rng(1)
    covered = 0
    trials = 400
    for _ in range(trials):
        matrix = (1.0 + 0.01 * rng.standard_normal((3, 2)))
        means = resample_means(matrix, 400, rng, 0.95)[:, 0]
        lo, hi = np.quantile(means, [0.025, 0.975])
        covered += lo <= 1.0 <= hi
    assert 0.9 <= covered / trials <= 0.99
    assert widening(3, 0.95) == pytest.approx(math.sqrt(1.5) * 4.302653 / 1.959964, rel=1e-5)


def test_true_zero_regret_with_one_percent_noise_never_fails_at_six_seeds():
    rng = np.random.default_rng(0)
    verdicts = []
    for _ in range(40):
        curves, grid = noisy_curves([-4.2, -4.2, -4.2], 0.02, 0.01, 6, rng)
        verdicts.append(decide(curves, grid).verdict)
    assert "does not transfer" not in verdicts
    assert verdicts.count("transfers") >= 30  # and the test has the power to say so most of the time


def test_true_five_percent_regret_with_half_percent_noise_does_not_transfer():
    rng = np.random.default_rng(0)
    for seeds in (3, 6):
        for _ in range(20):
            # half a grid step of drift (within the drift limit) on a steep curve: reusing costs 5%
            curves, grid = noisy_curves([-4.0, -4.0, -3.5], 0.2, 0.005, seeds, rng)
            d = decide(curves, grid)
            assert d.verdict == "does not transfer", d.reason
            assert d.scales[2].regret == pytest.approx(0.05, abs=0.01)
            assert "above the 2% cap" in d.reason


def test_a_2_percent_point_regret_with_noisy_seeds_is_inconclusive_and_says_how_many_seeds_decide():
    rng = np.random.default_rng(3)
    curves, grid = noisy_curves([-4.0, -4.0, -4.0 + math.sqrt(0.021 / 0.2)], 0.2, 0.015, 1, rng)
    one = decide(curves, grid)
    assert one.verdict == "inconclusive" and "one seed" in one.reason and one.seeds_to_decide == 3
    # the same truth with three noisy seeds: still inconclusive, and the report says what would decide it
    rng = np.random.default_rng(3)
    curves, grid = noisy_curves([-4.0, -4.0, -4.0 + math.sqrt(0.021 / 0.2)], 0.2, 0.015, 3, rng)
    three = decide(curves, grid)
    assert three.verdict == "inconclusive" and three.seeds_to_decide > 3
    assert f"about {three.seeds_to_decide} seeds" in three.reason or "more than 100 seeds" in three.reason


def test_noise_free_seeds_decide_and_a_drift_beyond_the_limit_does_not_transfer():
    rng = np.random.default_rng(0)
    curves, grid = noisy_curves([-6.0, -4.5, -3.0], 0.01, 0.0, 3, rng)
    d = decide(curves, grid)
    assert d.verdict == "does not transfer"
    assert d.scales[2].drift_interval == pytest.approx((3.0, 3.0))


def test_power_notes_say_when_the_cap_cannot_bind_and_when_the_limits_clash():
    rng = np.random.default_rng(0)
    flat, grid = noisy_curves([-4.0] * 3, 0.002, 0.001, 3, rng)
    assert any("low power" in n for n in decide(flat, grid).notes)
    steep, grid = noisy_curves([-4.0] * 3, 0.03, 0.001, 3, rng)
    assert any("contradict" in n for n in decide(steep, grid).notes)


def test_a_seed_whose_whole_curve_lies_higher_does_not_widen_the_drift():
    """Seeds shift whole curves. Modelled on width-mlp's rescaled AdamW at width 512: one seed 3.4% above
    the rest at every lr, 0.5% of seed-by-lr noise, six seeds at the optimum and its neighbours, one seed
    elsewhere, the top edge 4.6% above the minimum. The optimum sits still at every scale, so the drift
    interval stays inside one step. Resampling each lr's seeds on its own counted the offset as noise at
    every lr and let the one-seed edge points win some resamples: drift intervals of about [-3, +3] steps in
    every draw. (One draw of five puts a one-seed point within 2% of the minimum: a closer call.)"""
    lrs = [2.0**k for k in range(-5, 3)]
    shape = [1.23, 1.12, 1.07, 1.023, 1.0, 1.019, 1.05, 1.046]  # loss / its minimum at each lr
    offsets = [-0.014, 0.001, 0.001, -0.002, -0.02, 0.034]
    scales = (64, 128, 256, 512)
    decided = []
    for trial in range(5):
        rng = np.random.default_rng(trial)
        rows = []
        for scale in scales:
            for lr, relative in zip(lrs, shape):
                for seed in (range(6) if 0.25 <= lr <= 1 else [0]):
                    loss = 0.437 * relative * (1 + offsets[seed]) * (1 + 0.005 * rng.standard_normal())
                    rows.append({"optimizer": "adamw", "scale": scale, "lr": lr, "seed": seed, "train_loss": loss})
        records = parse_records(rows)
        grid = make_grid(lrs)
        curves = [build_curve(s, [r for r in records if r.scale == s], "train_loss", grid) for s in scales]
        d = decide_transfer(curves, grid.step_log2, resamples=1000)
        assert d.verdict != "does not transfer", d.reason
        within = all(-1 <= lo and hi <= 1 for lo, hi in (st.drift_interval for st in d.scales[1:]))
        decided.append(within and d.verdict == "transfers")
    assert sum(decided) >= 4, decided
