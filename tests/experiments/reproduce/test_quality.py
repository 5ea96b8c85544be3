"""The quality judge on synthetic stored cells (a real sweep store, no training)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from moga.experiments.reproduce import quality
from moga.experiments.reproduce.catalog import Reproduction, get
from moga.sweep.spec import Sweep
from tests.experiments.reproduce.synthetic import LRS, SEEDS, WIDTHS, parabola, store_losses, sweep_dict

def judged(tmp_path, floors: dict, optima: dict, noise=(0.0, 0.0, 0.0), diverge=None) -> dict:
    """floors/optima: {(optimizer, width): value}; seeds add ``noise[seed]`` relative."""
    sweep = Sweep.from_dict(sweep_dict())

    def loss(p):
        key = (p["optim.name"], p["model.n_embd"])
        if diverge and diverge(p):
            return math.inf
        return parabola(optima[key], floors[key])(p["optim.lr"]) * (1 + noise[p["seed"]])

    store_losses(tmp_path, sweep, loss)
    rep = Reproduction("quality", "width", "f", "c", "quality",
                       {"quality": {"subject": "moga", "baselines": ["adamw", "muon"], "goal": 0.02}})
    return quality.judge_quality(rep, sweep, tmp_path, 0.02)


def grid(moga: list[float], adamw: list[float], muon: list[float], moga_optima=(-4, -4, -4)):
    floors = {**{("moga", w): f for w, f in zip(WIDTHS, moga)}, **{("adamw", w): f for w, f in zip(WIDTHS, adamw)},
              **{("muon", w): f for w, f in zip(WIDTHS, muon)}}
    optima = {**{("moga", w): o for w, o in zip(WIDTHS, moga_optima)},
              **{("adamw", w): -8 - i for i, w in enumerate(WIDTHS)}, **{("muon", w): -6 for w in WIDTHS}}
    return floors, optima


def test_a_gap_growing_with_width_fails_at_the_widths_beyond_the_goal(tmp_path):
    """The issue's numbers: MOGA 0.9%, 4.2% and 8.2% above tuned AdamW; Muon better still at 256."""
    floors, optima = grid(moga=[1.774, 1.706, 1.670], adamw=[1.759, 1.638, 1.543], muon=[1.80, 1.70, 1.455])
    out = judged(tmp_path, floors, optima, noise=(0.0, 0.002, -0.002))
    assert out["outcome"] == "failed"
    cells = {c["scale"]: c for c in out["cells"]}
    assert [cells[w]["outcome"] for w in WIDTHS] == ["held", "failed", "failed"]
    assert cells[64]["baseline"] == "adamw" and cells[256]["baseline"] == "muon"
    assert cells[256]["relative"] == pytest.approx(1.670 / 1.455 - 1, abs=1e-9)  # the same noise on both sides
    assert cells[256]["low"] <= cells[256]["relative"] <= cells[256]["high"]
    # each baseline at its own best lr per width: AdamW's moves one grid step per doubling
    assert [cells[w]["others"]["adamw"]["lr"] for w in WIDTHS] == [2.0**-8, 2.0**-9, 2.0**-10]
    assert len(cells[64]["subject_losses"]) == 3 and len(cells[64]["baseline_losses"]) == 3
    stored = json.loads((tmp_path / "report" / "quality.json").read_text())
    assert stored[2]["outcome"] == "failed" and "width 256" in (tmp_path / "report" / "quality.md").read_text()


def test_moga_keeps_the_lr_tuned_at_the_smallest_width(tmp_path):
    """At width 256 MOGA's own best rate is 2^-2, but the claim is about the transferred 2^-4."""
    floors, optima = grid(moga=[1.0, 1.0, 1.0], adamw=[1.0, 1.0, 1.0], muon=[1.1, 1.1, 1.1], moga_optima=(-4, -3, -2))
    out = judged(tmp_path, floors, optima)
    cells = {c["scale"]: c for c in out["cells"]}
    assert {c["subject_lr"] for c in cells.values()} == {2.0**-4}
    assert cells[256]["subject_loss"] == pytest.approx(1.0 * (1 + 0.01 * 4))  # two grid steps off its optimum
    assert [cells[w]["outcome"] for w in WIDTHS] == ["held", "held", "failed"]
    assert (cells[64]["low"], cells[64]["high"]) == (0.0, 0.0)  # no seed noise, no width


def test_seed_noise_larger_than_the_gap_is_inconclusive(tmp_path):
    floors, optima = grid(moga=[1.02] * 3, adamw=[1.0] * 3, muon=[1.1] * 3)
    out = judged(tmp_path, floors, optima, noise=(-0.05, 0.0, 0.05))
    assert out["outcome"] == "undecided"
    assert all(c["outcome"] == "inconclusive" and c["low"] < 0.02 < c["high"] for c in out["cells"])


def test_a_diverged_seed_of_the_transferred_rate_fails_the_width(tmp_path):
    floors, optima = grid(moga=[1.0] * 3, adamw=[1.0] * 3, muon=[1.1] * 3)
    out = judged(tmp_path, floors, optima,
                 diverge=lambda p: p["optim.name"] == "moga" and p["model.n_embd"] == 256 and p["seed"] == 1)
    cells = {c["scale"]: c for c in out["cells"]}
    assert cells[256]["relative"] == "inf" and cells[256]["outcome"] == "failed"  # stored as the string "inf"
    assert cells[256]["note"] == "diverged on 1 of 3 seeds" and cells[128]["outcome"] == "held"
    assert out["outcome"] == "failed"


def test_a_win_over_a_baseline_tuned_on_its_grid_edge_decides_nothing(tmp_path):
    floors, optima = grid(moga=[1.0] * 3, adamw=[1.05] * 3, muon=[1.1] * 3)
    optima.update({("adamw", w): -12 for w in WIDTHS})  # AdamW's optimum lies below its grid: best lr on the edge
    out = judged(tmp_path, floors, optima)
    assert all(c["baseline"] == "adamw" and c["baseline_lr_on_edge"] and c["relative"] < 0 for c in out["cells"])
    assert all(c["outcome"] == "inconclusive" for c in out["cells"]) and out["outcome"] == "undecided"


def test_the_verdict_reads_the_interval_against_the_goal():
    assert quality.verdict(0.0, 0.019) == "held" and quality.verdict(0.021, 0.05) == "failed"
    assert quality.verdict(0.01, 0.03) == "inconclusive"


def test_the_shipped_quality_reproduction_is_judged_by_this_module():
    rep = get("quality")
    assert rep.kind == "quality" and rep.raw["quality"]["baselines"] == ["adamw", "muon"]
    for scale in ("quick", "cpu", "paper"):
        sweep = rep.sweep(scale)
        assert len(sweep.spec.axes["seed"]) >= 3
        assert sweep.spec.axes["model.name"] == ["gpt", "moga.integrations.llama:llama"]
    assert get("quality").sweep("paper").spec.axes["model.n_embd"] == [64, 128, 256, 512]


def test_a_multiplier_tuned_at_the_smallest_width_is_judged_at_every_width(tmp_path):
    """The transfer report on a sweep of the readout's multiplier: its optimum stays at 1/2 up to width 128 and
    moves to 2 at 256, where keeping 1/2 costs 4%."""
    spec = sweep_dict()
    spec["axes"] = {"optim.lr_multipliers.readout": {"pow2": [-3, 2]}, "model.n_embd": WIDTHS, "seed": SEEDS}
    spec["base"]["optim"]["lr"] = 0.0625
    spec["lr_key"] = "optim.lr_multipliers.readout"
    sweep = Sweep.from_dict(spec)
    optimum = {64: -1, 128: -1, 256: 1}
    store_losses(tmp_path, sweep, lambda p: parabola(optimum[p["model.n_embd"]], 2.0)(p["optim.lr_multipliers.readout"])
                 * (1 + 0.001 * p["seed"]))
    text = quality.transfer_report(tmp_path)
    cells = json.loads((tmp_path / "transfer.json").read_text())
    assert [c["subject_lr"] for c in cells] == [0.5] * 3 and [c["baseline_lr"] for c in cells] == [0.5, 0.5, 2.0]
    assert [c["outcome"] for c in cells] == ["held", "held", "failed"]
    assert cells[2]["relative"] == pytest.approx(0.04, abs=1e-9)
    assert text.startswith("optim.lr_multipliers.readout tuned at width 64")


def test_a_sweep_of_the_subject_under_another_setting_is_judged_against_the_claims_baselines(tmp_path):
    """The claim's run holds MOGA with the papers' preset (6% above Muon); a MOGA-only sweep with the tables at
    1/16 (2% below Muon at width 64, 1% above at 256) takes its place against the same tuned baselines."""
    floors, optima = grid(moga=[1.06, 1.06, 1.06], adamw=[1.1, 1.1, 1.1], muon=[1.0, 1.0, 1.0])
    judged(tmp_path / "claim", floors, optima, noise=(0.0, 0.001, -0.001))
    spec = sweep_dict()
    spec["axes"] = {"optim.name": ["moga"], "model.n_embd": WIDTHS, "seed": SEEDS, "optim.lr": LRS["moga"]}
    spec["base"]["optim"]["lr_multipliers"] = {"embedding": 0.0625}
    new = {64: 0.98, 128: 1.0, 256: 1.01}
    store_losses(tmp_path / "new", Sweep.from_dict(spec), lambda p: parabola(-4, new[p["model.n_embd"]])(
        p["optim.lr"]) * (1 + 0.001 * p["seed"]))
    text = quality.versus_report(tmp_path / "new", tmp_path / "claim")
    cells = json.loads((tmp_path / "new" / "versus.json").read_text())
    assert [c["baseline"] for c in cells] == ["muon"] * 3 and [c["subject_lr"] for c in cells] == [2.0**-4] * 3
    assert [c["relative"] for c in cells] == pytest.approx([-0.02 + 0.001, 0.001, 0.011], abs=2e-4)
    assert [c["outcome"] for c in cells] == ["held", "held", "held"] and "muon 1.0000" in text
    spec["base"]["train"]["steps"] = 4  # not the claim's experiment
    store_losses(tmp_path / "other", Sweep.from_dict(spec), lambda p: 1.0)
    with pytest.raises(SystemExit, match="train.steps differ"):
        quality.versus_report(tmp_path / "other", tmp_path / "claim")


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_instead_of_reading_it_as_a_run_directory(flag, tmp_path):
    done = subprocess.run([sys.executable, "-m", "moga.experiments.reproduce.quality", "ablation", flag],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("usage:") and not (tmp_path / flag).exists(), done.stderr
