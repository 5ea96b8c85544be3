"""The convergence claims decided over seeds from per-seed numbers: known orderings and growths with known noise."""

import pytest

from moga.experiments.smoothness.checks import _resamples, depth_order, growth_check, judge_checks

DEPTHS = [2, 3, 4, 6, 8]


def test_the_seed_bootstrap_enumerates_every_resample_with_its_weight():
    picks = list(_resamples(3))
    assert len(picks) == 10 and sum(w for _, w in picks) == pytest.approx(1.0)  # 27 draws as 10 multisets
    assert dict(picks)[(0, 0, 0)] == pytest.approx(1 / 27) and dict(picks)[(0, 1, 2)] == pytest.approx(6 / 27)


def test_deeper_slower_holds_only_when_every_resample_of_the_seeds_orders_the_depths():
    rising = [[0.5, 0.4, 0.45, 0.6, 0.9], [0.5, 0.41, 0.44, 0.62, 0.95], [0.5, 0.39, 0.46, 0.58, 0.85]]
    held = depth_order(DEPTHS, rising)
    assert held["verdict"] == "held" and held["per_seed"] == [1.0, 1.0, 1.0] and held["low"] == 1.0
    assert held["depths"] == [3, 4, 6, 8]  # L = 2 is the paper's exception
    falling = [[x[0], *reversed(x[1:])] for x in rising]
    assert depth_order(DEPTHS, falling)["verdict"] == "failed"
    # two seeds rise, one falls steeply: the resample of three copies of it (1/27 > 2.5%) breaks the order
    split = depth_order(DEPTHS, rising[:2] + [[0.5, 2.0, 1.5, 1.0, 0.5]])
    assert split["verdict"] == "inconclusive" and split["agreeing"] == 2 and split["low"] < 0.8 <= split["high"]
    # one seed is never enough, however clear
    one = depth_order(DEPTHS, rising[:1])
    assert one["verdict"] == "inconclusive" and one["spearman"] == 1.0
    # a diverged depth (a stored null) drops out; too few finite depths is not measured
    assert depth_order([3, 4, 6], [[0.4, None, 0.6]] * 3)["verdict"] == "not measured"


def test_w_growth_is_decided_by_its_seed_interval_against_the_one_percent_bar():
    assert growth_check([0.10, 0.12, 0.11], [True] * 3)["verdict"] == "held"
    assert growth_check([0.001, 0.002, 0.0015], [True] * 3)["verdict"] == "failed"
    noisy = growth_check([0.20, -0.10, 0.05], [True, False, True])
    assert noisy["verdict"] == "inconclusive" and noisy["low"] < 0.01 < noisy["high"]
    assert growth_check([0.5], [True])["verdict"] == "inconclusive"  # one seed: no interval
    assert growth_check([0.10, 0.12, 0.11], [True, False, True])["verdict"] == "inconclusive"  # fell at the end
    assert growth_check([0.1, None], [True, None])["verdict"] == "not measured"


def test_the_claim_is_judged_from_stored_numbers_alone():
    numbers = {"adaptive_vs_constant": [{"data": "d", "seeds": [0, 1, 2], "adaptive": [1.0, 1.1, 0.9],
                                         "constant": [{"lr": 0.1, "losses": [1.2, 1.31, 1.12]},
                                                      {"lr": 0.3, "losses": [None, 1.6, 1.4]}]}],
               "deeper_slower": {"adaptive": {"depths": DEPTHS, "seeds": [0, 1, 2],
                                              "losses": [[0.5, 0.4, 0.45, 0.6, 0.9]] * 3}},
               "w_growth": {"adaptive": {"seeds": [0, 1, 2], "growth": [0.2, -0.1, 0.05],
                                         "rose_last_quarter": [True, False, True]}}}
    checks = judge_checks(numbers)
    assert [c["state"] for c in checks] == ["held", "held", "inconclusive"]
    assert "Student t over 3 paired seeds" in checks[0]["text"]
    assert "per seed 1.00, 1.00, 1.00: 3 of 3 >= 0.8" in checks[1]["text"]
    assert "per seed +20.0%, -10.0%, +5.0%" in checks[2]["text"] and "more seeds would decide it" in checks[2]["text"]
