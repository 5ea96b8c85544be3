"""Proxy selection: the largest rungs that fit the budget, in a stated regime; a budget or target too small says so."""

import pytest

from moga.experiments.tune.knobs import TuneError
from moga.experiments.tune.plan import plan_tuning, planned_cells, rungs
from moga.experiments.tune.run import prepare

BASE = {"seed": 0, "model": {"name": "gpt", "n_embd": 256, "n_head": 16, "n_layer": 8},
        "data": {"name": "text", "tokenizer": "char", "block_size": 32},
        "optim": {"name": "moga"}, "train": {"steps": 200, "batch_size": 8}}


def setup(**kw):
    base, knobs, target, _ = prepare(BASE, **kw)
    return base, knobs, target


def test_rungs_halve_the_width_and_the_depth_every_second_rung_keeping_heads_of_16():
    _, knobs, target = setup()
    assert target == (256, 8) and knobs.keys(64, 2)["n_head"] == 4
    assert rungs(target, knobs) == [(128, 4), (64, 4), (32, 2), (16, 2)]


@pytest.mark.parametrize("budget", [3e11, 1e12, 1e13])
def test_proxies_are_the_largest_rungs_that_fit_the_budget(budget):
    base, knobs, target = setup()
    p = plan_tuning(base, knobs, target, 6, budget_flops=budget)
    cells = planned_cells(6, 3)
    assert p.planned_flops == pytest.approx(sum(s.flops for s in p.proxies) * cells)
    assert p.planned_flops <= budget and 2 <= len(p.proxies) <= 3
    ladder = rungs(target, knobs)
    top = ladder.index((p.proxies[-1].width, p.proxies[-1].depth))
    if top > 0:  # the rung above would not have fit with the one below it
        bigger = plan_tuning(base, knobs, target, 6, budget_flops=1e30, proxies=ladder[top - 1:top + 1])
        assert bigger.planned_flops > budget
    assert p.regime == "steps" and all(s.steps == 200 for s in p.proxies)  # 200 steps is far below 20 tokens/param


def test_tokens_regime_keeps_tokens_per_parameter():
    base, knobs, target = setup()
    p = plan_tuning(base, knobs, target, 6, budget_flops=1e30, regime="tokens")
    tpp = p.target.steps / p.target.params
    for s in p.proxies:
        assert s.steps == pytest.approx(tpp * s.params, abs=1)
    assert any("tokens per parameter" in r for r in p.reasons)


@pytest.mark.parametrize("kw,message", [
    ({"budget_flops": 1e6}, "is too small for two proxies: the two smallest"),
    ({"budget_flops": 1e15, "proxies": [(64, 4), (512, 2)]}, "is not larger than proxy 512x2"),
    ({"budget_flops": 1e15, "proxies": [(64, 4), (256, 8)]}, "is not larger than proxy 256x8"),
])
def test_bad_budgets_and_proxies_get_one_line(kw, message):
    base, knobs, target = setup()
    with pytest.raises(TuneError, match=message) as e:
        plan_tuning(base, knobs, target, 6, **kw)
    assert "\n" not in str(e.value)


def test_a_target_too_small_for_two_proxies_says_so():
    base, knobs, target = setup(width=32, depth=2)
    with pytest.raises(TuneError, match="too small for two proxies below it"):
        plan_tuning(base, knobs, target, 6, budget_flops=1e15)
