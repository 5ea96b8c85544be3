"""The gap-width claim: its width-by-width stages on a real sweep store (cells finished with known losses, no
training) and its judge on known gaps. The engine's alignment records: tests/train/test_diagnostics.py."""

from __future__ import annotations

import json
import math

import pytest

from moga.experiments.reproduce import gap, gap_stages
from moga.experiments.reproduce.catalog import Reproduction, get
from moga.experiments.reproduce.reproduction import ReproduceError
from moga.experiments.reproduce.run import rejudge
from moga.status import Status
from moga.sweep.store import SweepStore

ROW, ORTH = "row(p=2)", "spectral"
WIDTHS = [16, 32, 64, 128]


def reproduction(widths=WIDTHS, narrow_from=64, row=(-6, -1), orth=(-9, -3), steps=3, models=("gpt",)) -> Reproduction:
    raw = {"gap": {"contender_key": "optim.geometries.hidden", "subject": ROW, "baseline": ORTH,
                   "panel_keys": ["model.name"], "narrow_from": narrow_from},
           "sweep": {"base": {"seed": 0, "model": {"name": "gpt", "n_layer": 1, "n_head": 1},
                              "data": {"name": "text", "tokenizer": "char", "block_size": 8},
                              "optim": {"name": "moga", "preset": "paper"},
                              "train": {"steps": steps, "batch_size": 2},
                              "eval": {"every": 0, "train_eval": False, "final_window": 2, "max_batches": 1},
                              "logging": {"progress": False, "log_every": 1, "alignment_every": 1}},
                     "axes": {"model.n_embd": list(widths), "model.name": list(models),
                              "optim.geometries.hidden": [ROW, ORTH],
                              "optim.lr": {"by": "optim.geometries.hidden",
                                           "values": {ROW: {"pow2": list(row)}, ORTH: {"pow2": list(orth)}}}},
                     "scale_key": "model.n_embd"},
           "scales": {"cpu": {}}}
    return Reproduction("gap-test", "width", "f", "the gap closes", "gap", raw)


def fake_run(out, loss):
    """``run(sweep)`` for :func:`gap_stages.run_staged`: every unsettled cell of the grid finishes with ``loss(params)``."""
    ran = []

    def run(sweep):
        store = SweepStore(out)
        store.create_or_check(sweep)
        rows = []
        for cell in store.cells():
            if cell["status"] == Status.PENDING:
                ran.append(cell["params"])
                rows.append((str(Status.FINISHED), json.dumps({"final_train_loss": loss(cell["params"])}), cell["id"]))
        with store._write() as con:
            con.executemany("UPDATE cells SET status = ?, result = ? WHERE id = ?", rows)
        return {"finished": len(rows)}

    return run, ran


def parabola(optima: dict, floors: dict, noise=(0.0, 0.004, -0.004)):
    """A loss with its optimum at 2^optima[(geometry, width)] and floor floors[(geometry, width)]; seeds add noise."""
    def loss(p):
        key = (p["optim.geometries.hidden"], p["model.n_embd"])
        return floors[key] * (1 + 0.01 * (math.log2(p["optim.lr"]) - optima[key]) ** 2) * (1 + noise[p.get("seed", 0)])
    return loss


def floors_with_gaps(gaps: dict) -> dict:
    return {**{(ORTH, w): 2.0 for w in gaps}, **{(ROW, w): 2.0 * (1 + g) for w, g in gaps.items()}}


def staged(tmp_path, optima, floors, **kw):
    rep = reproduction(**kw)
    run, ran = fake_run(tmp_path, parabola(optima, floors))
    sweep, _ = gap_stages.run_staged(rep, "cpu", None, tmp_path, run, min_seeds=3)
    return rep, sweep, ran


def test_narrow_widths_run_three_rates_around_the_transferred_optimum_and_seeds_at_each_best(tmp_path):
    optima = {**{(ROW, w): -3 for w in WIDTHS}, **{(ORTH, w): -6 for w in WIDTHS}}
    rep, sweep, ran = staged(tmp_path, optima, floors_with_gaps(dict.fromkeys(WIDTHS, 0.05)))
    for w in (64, 128):  # narrow: the best at the smaller width and one step either side, seed 0 each
        for geometry, best in ((ROW, -3), (ORTH, -6)):
            rates = sorted({p["optim.lr"] for p in ran if p["model.n_embd"] == w
                            and p["optim.geometries.hidden"] == geometry})
            assert rates == [2.0 ** (best - 1), 2.0 ** best, 2.0 ** (best + 1)]
    for w in (16, 32):  # the whole grid
        assert len({p["optim.lr"] for p in ran if p["model.n_embd"] == w and p["optim.geometries.hidden"] == ROW}) == 6
    seeds = {(p["model.n_embd"], p["optim.geometries.hidden"], p["optim.lr"], p.get("seed", 0)) for p in ran}
    for w in WIDTHS:  # three seeds at each best rate, one elsewhere
        assert {s for (ww, g, lr, s) in seeds if ww == w and g == ROW and lr == 2.0 ** -3} == {0, 1, 2}
        assert {s for (ww, g, lr, s) in seeds if ww == w and g == ROW and lr == 2.0 ** -2} == {0}
    # widths ran in order: no cell of a wider model before every cell of a narrower one, seeds included
    order = [p["model.n_embd"] for p in ran]
    assert order == sorted(order)
    # resuming runs nothing more
    run, again = fake_run(tmp_path, lambda p: 1.0)
    gap_stages.run_staged(rep, "cpu", None, tmp_path, run, min_seeds=3)
    assert again == []


def test_a_best_rate_on_the_narrow_grids_edge_widens_it_until_it_is_inside(tmp_path):
    optima = {**{(ROW, w): -3 for w in WIDTHS}, **{(ORTH, w): -6 for w in WIDTHS}}
    optima[(ROW, 128)] = -6  # three steps below the transferred -3: two widenings
    _, _, ran = staged(tmp_path, optima, floors_with_gaps(dict.fromkeys(WIDTHS, 0.05)))
    rates = sorted({p["optim.lr"] for p in ran if p["model.n_embd"] == 128 and p["optim.geometries.hidden"] == ROW})
    assert rates == [2.0 ** k for k in range(-6, -1)]  # the grid's low end reached: -6 is its lowest rate


@pytest.mark.parametrize("gaps, verdict, outcome", [
    ({16: 0.12, 32: 0.09, 64: 0.06, 128: 0.03}, "closes", "held"),
    ({16: 0.06, 32: 0.07, 64: 0.08, 128: 0.09}, "does not close", "failed"),
    ({16: 0.08, 32: 0.08, 64: 0.08, 128: 0.08}, "does not close", "failed"),
])
def test_the_slope_of_the_gap_against_log2_width_decides(tmp_path, gaps, verdict, outcome):
    optima = {**{(ROW, w): -3 for w in WIDTHS}, **{(ORTH, w): -6 for w in WIDTHS}}
    rep, sweep, _ = staged(tmp_path, optima, floors_with_gaps(gaps))
    result = gap.judge_gap(rep, sweep, tmp_path)
    panel = result["panels"][0]
    assert panel["verdict"] == verdict and result["outcome"] == outcome
    expected = (gaps[128] - gaps[16]) / 3  # the gaps are linear in log2(width): the fit is exact
    assert panel["slope"] == pytest.approx(expected, abs=2e-3)
    assert panel["slope_low"] <= panel["slope"] <= panel["slope_high"]
    for w in result["widths"]:
        assert w["gap"] == pytest.approx(gaps[w["scale"]], abs=2e-3) and w["low"] <= w["gap"] <= w["high"]
        assert w["seeds"] == 3 and not w["subject_lr_on_edge"] and not w["baseline_lr_on_edge"]
    assert rejudge(json.loads(json.dumps(result)), [])["panels"] == result["panels"]  # the stored cells recheck


def test_noise_larger_than_the_trend_is_inconclusive_and_a_grid_edge_decides_nothing(tmp_path):
    optima = {**{(ROW, w): -3 for w in WIDTHS}, **{(ORTH, w): -6 for w in WIDTHS}}
    gaps = {16: 0.08, 32: 0.07, 64: 0.08, 128: 0.07}
    rep = reproduction()
    noisy = parabola(optima, floors_with_gaps(gaps), noise=(0.0, 0.06, -0.06))
    run, _ = fake_run(tmp_path / "noisy", noisy)
    sweep, _ = gap_stages.run_staged(rep, "cpu", None, tmp_path / "noisy", run, min_seeds=3)
    assert gap.judge_gap(rep, sweep, tmp_path / "noisy")["panels"][0]["verdict"] == "inconclusive"

    optima[(ORTH, 16)] = -9  # the grid's lowest rate: an optimum that may lie below it
    rep2, sweep2, _ = staged(tmp_path / "edge", optima, floors_with_gaps(gaps))
    result = gap.judge_gap(rep2, sweep2, tmp_path / "edge")
    assert result["panels"][0]["verdict"] == "no verdict" and result["outcome"] == "undecided"


def test_a_store_missing_widths_is_partial_and_never_decides_the_claim(tmp_path):
    optima = {**{(ROW, w): -3 for w in WIDTHS}, **{(ORTH, w): -6 for w in WIDTHS}}
    rep, sweep, _ = staged(tmp_path, optima, floors_with_gaps({16: 0.12, 32: 0.09, 64: 0.06}),
                           widths=[16, 32, 64])
    full = reproduction()  # the claim names width 128 too: its cells have not run
    result = gap.judge_gap(full, full.sweep("cpu"), tmp_path)
    assert result["panels"][0]["verdict"] == "closes"  # over the widths that ran
    assert result["outcome"] == "inconclusive" and result["partial"]["missing"] == {"gpt": [128]}
    assert result["key"].startswith("partial")
    assert rejudge(json.loads(json.dumps(result)), [])["outcome"] == "inconclusive"


def test_a_store_seeded_with_a_stored_outcome_runs_only_the_rest_and_judges_as_the_whole(tmp_path):
    """The narrower widths' cells from a stored outcome (prior.json): only width 128 runs, at the rates and seeds
    the whole run chose there from width 64's best, and the judge gives the whole run's verdict and numbers."""
    optima = {**{(ROW, w): -3 for w in WIDTHS}, **{(ORTH, w): -6 for w in WIDTHS}}
    optima[(ROW, 64)] = optima[(ROW, 128)] = -4  # width 128's narrow rates follow width 64's best
    floors = floors_with_gaps({16: 0.12, 32: 0.09, 64: 0.06, 128: 0.03})
    rep, sweep, ran = staged(tmp_path / "whole", optima, floors)
    whole = {**gap.judge_gap(rep, sweep, tmp_path / "whole"), "name": rep.name, "scale": "cpu"}
    stored = tmp_path / "outcome.json"
    stored.write_text(json.dumps({**whole, "seconds": 100.0}))
    gap_stages.seed_store(tmp_path / "rest", stored, 128)
    clock = tmp_path / "rest" / "seconds.json"
    assert json.loads(clock.read_text()) == {"seconds": 100.0}  # the claim's time includes its cells' time
    run, rest = fake_run(tmp_path / "rest", parabola(optima, floors))
    seeded_sweep, _ = gap_stages.run_staged(rep, "cpu", None, tmp_path / "rest", run, min_seeds=3)

    def cells(params):
        return sorted((p["model.n_embd"], p["optim.geometries.hidden"], p["optim.lr"], p.get("seed", 0)) for p in params)
    assert cells(rest) == cells(p for p in ran if p["model.n_embd"] == 128)
    assert {lr for (_, g, lr, _) in cells(rest) if g == ROW} == {2.0 ** -5, 2.0 ** -4, 2.0 ** -3}
    seeded = gap.judge_gap(rep, seeded_sweep, tmp_path / "rest")
    for field in ("outcome", "key", "details", "panels", "widths"):
        assert seeded[field] == whole[field], field
    assert seeded["prior"]["widths"] == [16, 32, 64] and seeded["prior"]["source"] == str(stored)
    assert "cells of a stored outcome" in (tmp_path / "rest" / "report" / "gap.md").read_text()
    assert rejudge(json.loads(json.dumps(seeded)), [])["panels"] == whole["panels"]  # its stored cells recheck

    other = tmp_path / "other.json"  # another claim's outcome is refused where it would run or judge
    other.write_text(json.dumps({**whole, "name": "another"}))
    gap_stages.seed_store(tmp_path / "wrong", other, 128)
    with pytest.raises(ReproduceError, match="holds another at scale cpu, not gap-test"):
        gap_stages.run_staged(rep, "cpu", None, tmp_path / "wrong", fake_run(tmp_path / "wrong", lambda p: 1.0)[0], 3)
    gap_stages.seed_store(tmp_path / "rest", stored, 128)  # the same prior again: nothing changes
    assert json.loads(clock.read_text()) == {"seconds": 100.0}
    with pytest.raises(ReproduceError, match="holds other cells"):
        gap_stages.seed_store(tmp_path / "rest", stored, 64)
    with pytest.raises(ReproduceError, match="no cell below width 16"):
        gap_stages.seed_store(tmp_path / "none", stored, 16)
    with pytest.raises(ReproduceError, match="not a stored gap outcome"):
        gap_stages.seed_store(tmp_path / "none", tmp_path / "rest" / "prior.json", 128)


def test_its_report_replaces_a_symlink_planted_at_gap_md(tmp_path):
    """A store from a shared disk may carry a link at report/gap.md: replaced (moga.files), never written through."""
    optima = {**{(ROW, w): -3 for w in WIDTHS}, **{(ORTH, w): -6 for w in WIDTHS}}
    rep, sweep, _ = staged(tmp_path / "out", optima, floors_with_gaps({16: 0.12, 32: 0.09}), widths=[16, 32])
    outside, link = tmp_path / "outside.md", tmp_path / "out" / "report" / "gap.md"
    outside.write_text("precious\n")
    link.parent.mkdir()
    link.symlink_to(outside)
    gap.judge_gap(rep, sweep, tmp_path / "out")
    assert outside.read_text() == "precious\n"
    assert not link.is_symlink() and link.read_text().startswith("# gap-test: the gap closes")


def test_the_shipped_claim_runs_moga_default_on_every_role_but_the_hidden_matrices():
    rep = get("gap-width")
    assert rep.kind == "gap"
    for scale in ("quick", "cpu", "paper"):
        sweep = rep.sweep(scale)
        configs = [sweep.config(c) for c in sweep.cells]
        assert {c.optim.geometries["hidden"] for c in configs} == {ROW, ORTH}
        for c in configs:
            assert set(c.optim.geometries) == {"hidden"} and c.optim.nesterov is True
            assert c.optim.lr_multipliers == {"embedding": 0.0625} and c.logging.alignment_every > 0
            assert c.model.n_embd // c.model.kwargs.get("n_head", 1) in (16, 32, 64)
    assert rep.sweep("cpu").spec.axes["model.n_embd"][-1] >= 1024
    assert set(rep.sweep("cpu").spec.axes["model.name"]) == {"gpt", "moga.integrations.llama:llama"}
