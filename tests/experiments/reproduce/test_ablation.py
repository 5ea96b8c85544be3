"""The ablation: each value at its own tuned lr against the default, a baseline sweep, or a named variant."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moga.experiments.reproduce import ablation
from moga.sweep.spec import Sweep
from tests.experiments.reproduce.synthetic import LRS, SEEDS, parabola, store_losses, sweep_dict


def test_the_ablation_compares_each_value_at_its_own_tuned_lr(tmp_path):
    spec = sweep_dict()
    spec["axes"] = {"optim.geometries.readout": ["row(p=2)", "sign"], "model.n_embd": [64, 256], "seed": SEEDS,
                    "optim.lr": {"pow2": [-6, -2]}}
    sweep = Sweep.from_dict(spec)
    shape = {"row(p=2)": (-4, 1.0), "sign": (-3, 0.95)}  # sign: 5% lower loss at a rate twice as large

    def loss(p):
        optimum, floor = shape[p["optim.geometries.readout"]]
        return parabola(optimum, floor)(p["optim.lr"]) * (1 + 0.001 * p["seed"])

    store_losses(tmp_path, sweep, loss)
    text = ablation.ablation_report(tmp_path)
    entries = json.loads((tmp_path / "ablation.json").read_text())
    sign = [e for e in entries if e["variant"] == {"optim.geometries.readout": "sign"}]
    assert [e["lr"] for e in sign] == [2.0**-3, 2.0**-3]
    assert all(e["relative"] == pytest.approx(-0.05, abs=1e-3) and e["moves"] for e in sign)
    default = [e for e in entries if e["default"]]
    assert all(e["relative"] == 0 and not e["moves"] for e in default)
    assert "geometries.readout=sign" in text and "-5.0%" in text


def test_the_ablation_against_a_baseline_gives_each_value_its_gap_to_the_best_tuned_baseline(tmp_path):
    """Each value at its own tuned lr against the best of the baseline sweep's optimizers at its own tuned lr:
    AdamW (floor 1.0, optimum 2^-9) beats Muon (1.02) and is the reference; sign's 0.95 is 5% below it."""
    spec = sweep_dict()
    spec["axes"] = {"optim.geometries.readout": ["row(p=2)", "sign"], "model.n_embd": [64, 256], "seed": SEEDS,
                    "optim.lr": {"pow2": [-6, -2]}}
    shape = {"row(p=2)": (-4, 1.04), "sign": (-3, 0.95)}
    store_losses(tmp_path / "moga", Sweep.from_dict(spec), lambda p: parabola(*shape[p["optim.geometries.readout"]])(
        p["optim.lr"]) * (1 + 0.001 * p["seed"]))
    rivals = sweep_dict()
    rivals["axes"] = {"optim.name": ["adamw", "muon"], "model.n_embd": [64, 256], "seed": SEEDS,
                      "optim.lr": {"by": "optim.name", "values": {"adamw": LRS["adamw"], "muon": LRS["muon"]}}}
    floor = {"adamw": (-9, 1.0), "muon": (-6, 1.02)}
    store_losses(tmp_path / "rivals", Sweep.from_dict(rivals), lambda p: parabola(*floor[p["optim.name"]])(
        p["optim.lr"]) * (1 + 0.001 * p["seed"]))
    text = ablation.ablation_report(tmp_path / "moga", tmp_path / "rivals")
    entries = json.loads((tmp_path / "moga" / "ablation-baseline.json").read_text())
    assert all(e["reference"] == {"name": "adamw", "lr": 2.0**-9, "lr_on_edge": False} for e in entries)
    gaps = {(e["scale"], e["variant"]["optim.geometries.readout"]): e["relative"] for e in entries}
    assert gaps == pytest.approx({(64, "row(p=2)"): 0.04, (256, "row(p=2)"): 0.04, (64, "sign"): -0.05,
                                  (256, "sign"): -0.05}, abs=1e-9)
    assert all(e["moves"] for e in entries)
    assert "vs tuned adamw" in text and "adamw tuned at width 256: lr 0.00195312" in text
    # the baselines as two sweeps, one per optimizer (AdamW's, Muon's): the same best at each width
    for name in floor:
        one = sweep_dict()
        one["axes"] = {"optim.name": [name], "model.n_embd": [64, 256], "seed": SEEDS, "optim.lr": LRS[name]}
        store_losses(tmp_path / name, Sweep.from_dict(one), lambda p: parabola(*floor[p["optim.name"]])(
            p["optim.lr"]) * (1 + 0.001 * p["seed"]))
    assert ablation.ablation_report(tmp_path / "moga", [tmp_path / "muon", tmp_path / "adamw"]) == text
    assert json.loads((tmp_path / "moga" / "ablation-baseline.json").read_text()) == entries
    muon_only = ablation.ablation_report(tmp_path / "moga", tmp_path / "muon")
    assert "vs tuned muon" in muon_only and muon_only != text


def test_a_follow_up_sweep_is_judged_with_the_first_against_its_default(tmp_path):
    """A second sweep adds a choice (the table's lr multiplier) with its default excluded: judged together, its
    rows take the first sweep's defaults and its value is compared with the first sweep's default cells."""
    first = sweep_dict()
    first["axes"] = {"optim.geometries.readout": ["row(p=2)", "sign"], "model.n_embd": [64], "seed": SEEDS,
                     "optim.lr": {"pow2": [-6, -2]}}
    follow = sweep_dict()
    follow["axes"] = {"optim.lr_multipliers.embedding": [1.0, 0.125], "model.n_embd": [64], "seed": SEEDS,
                      "optim.lr": {"pow2": [-6, -2]}}
    follow["exclude"] = [{"optim.lr_multipliers.embedding": 1.0}]
    shape = {("row(p=2)", 1.0): (-4, 1.0), ("sign", 1.0): (-4, 1.01), ("row(p=2)", 0.125): (-3, 0.94)}

    def loss(p):
        key = (p.get("optim.geometries.readout", "row(p=2)"), p.get("optim.lr_multipliers.embedding", 1.0))
        return parabola(*shape[key])(p["optim.lr"]) * (1 + 0.001 * p["seed"])

    store_losses(tmp_path / "a", Sweep.from_dict(first), loss)
    store_losses(tmp_path / "b", Sweep.from_dict(follow), loss)
    text = ablation.ablation_report([tmp_path / "a", tmp_path / "b"])
    entries = json.loads((tmp_path / "a" / "ablation.json").read_text())
    got = {tuple(e["variant"].values()): (e["lr"], round(e["relative"], 6)) for e in entries}
    assert got == {("row(p=2)", 1.0): (2.0**-4, 0.0), ("sign", 1.0): (2.0**-4, 0.01),
                   ("row(p=2)", 0.125): (2.0**-3, -0.06)}
    assert "lr_multipliers.embedding=0.125" in text
    other = sweep_dict()  # another base config: not the same experiment
    other["axes"] = follow["axes"]
    other["base"]["train"]["steps"] = 4
    store_losses(tmp_path / "c", Sweep.from_dict(other), loss)
    with pytest.raises(SystemExit, match="base config differ"):
        ablation.ablation_report([tmp_path / "a", tmp_path / "c"])


def test_a_value_run_on_one_seed_is_not_said_to_move_the_loss():
    """One seed on a side leaves the bootstrap only the other side's seeds: a narrow interval that means nothing."""
    rows = [{"m": m, "w": 64, "seed": s, "optim.lr": 0.1, "train_loss": loss}
            for m, s, loss in ((0.9, 0, 2.0), (0.9, 1, 2.01), (0.9, 2, 2.02), (0.95, 0, 2.2))]
    entries = ablation.ablation(rows, {"m": [0.9, 0.95], "w": [64], "seed": [0, 1, 2], "optim.lr": [0.1]},
                               scale_key="w")
    one = next(e for e in entries if not e["default"])
    assert one["low"] > 0.08 and one["moves"] is None
    assert "| 1 | +9.5% [" in ablation.ablation_table(entries) and "one seed" in ablation.ablation_table(entries)


def test_the_ablation_against_a_named_variant_of_the_same_sweep():
    """docs/results.md's hybrids table: every contender at its own tuned lr against the published Muon, which runs
    in the same sweep; a dependent axis that follows optim.name is no choice, and a mapping value (a per-name
    geometry override) is a variant like any other."""
    attention = {"*.attn.*.weight": {"geometry": "spectral"}}
    variants = [("moga", None, 2.0), ("moga", attention, 1.9), ("muon", None, 1.8)]
    rows = [{"optim.name": name, "optim.overrides": over, "optim.betas": [0.9, 0.95] if name == "muon" else None,
             "w": 64, "seed": s, "optim.lr": lr, "train_loss": floor + 0.01 * s + (0.1 if lr == 0.2 else 0)}
            for name, over, floor in variants for s in (0, 1) for lr in (0.05, 0.1, 0.2)]
    axes = {"w": [64], "seed": [0, 1], "optim.name": ["moga", "muon"], "optim.overrides": [None, attention],
            "optim.betas": {"by": "optim.name", "values": {"moga": [None], "muon": [[0.9, 0.95]]}},
            "optim.lr": [0.05, 0.1, 0.2]}
    entries = ablation.ablation(rows, axes, scale_key="w", against={"optim.name": "muon"})
    by = {(e["variant"]["optim.name"], e["variant"]["optim.overrides"] is not None): e for e in entries}
    assert set(by) == {("moga", False), ("moga", True), ("muon", False)}  # betas follow optim.name
    assert by[("moga", True)]["relative"] == pytest.approx(1.905 / 1.805 - 1)
    assert by[("muon", False)]["relative"] == 0 and by[("moga", False)]["moves"]
    assert by[("moga", True)]["lr_on_edge"] and by[("moga", True)]["reference"]["lr_on_edge"]  # 0.05, the low edge
    table = ablation.ablation_table(entries)
    assert "vs tuned name=muon" in table
    # each row names what it runs, the axes that follow optim.name too; none is called the default it is judged
    # against (that is Muon here)
    assert "| 64 | name=muon, betas=[0.9, 0.95] |" in table and "(default)" not in table


def test_a_dependent_axis_of_several_values_is_a_choice_whose_default_is_its_first_lists_first():
    """configs/research/hybrid_gap.yaml: the hidden geometry depends on optim.name (four for moga, one for muon);
    each is a variant, and the default is moga's first."""
    hidden = {"by": "optim.name", "values": {"moga": ["row(p=2)", "spectral_row"], "muon": ["spectral"]}}
    variants = [("moga", "row(p=2)", 2.0), ("moga", "spectral_row", 1.7), ("muon", "spectral", 1.8)]
    rows = [{"optim.name": name, "optim.geometries.hidden": geo, "w": 64, "seed": s, "optim.lr": lr,
             "train_loss": floor + 0.01 * s + (0.1 if lr != 0.1 else 0)}
            for name, geo, floor in variants for s in (0, 1) for lr in (0.05, 0.1, 0.2)]
    axes = {"w": [64], "seed": [0, 1], "optim.name": ["moga", "muon"], "optim.geometries.hidden": hidden,
            "optim.lr": [0.05, 0.1, 0.2]}
    entries = ablation.ablation(rows, axes, scale_key="w", against={"optim.name": "muon"})
    by = {e["variant"]["optim.geometries.hidden"]: e for e in entries}
    assert by["row(p=2)"]["default"] and not by["spectral_row"]["default"]
    assert by["spectral_row"]["relative"] == pytest.approx(1.705 / 1.805 - 1) and by["spectral_row"]["moves"]
    with pytest.raises(ValueError, match="optim.geometries.hidden"):
        ablation.ablation(rows, {**axes, "optim.geometries.hidden": {"pow2": [-2, 0]}}, scale_key="w")


def test_against_a_name_tunes_the_named_optimizer_over_the_choices_it_leaves_open(tmp_path):
    """configs/research/race_64.yaml: Muon runs with weight decay 0 and 0.1 at the same rates and seeds. Against
    ``optim.name=muon`` the reference is Muon's better weight decay at its own best lr, not the two pooled (where one
    seed's loss would overwrite the other's); on the command line a value is the number the store holds."""
    spec = sweep_dict(**{"optim.weight_decay": [0.0, 0.1]})
    spec["axes"].update({"model.n_embd": [64], "optim.name": ["moga", "muon"],
                         "optim.lr": {"by": "optim.name", "values": {n: LRS[n] for n in ("moga", "muon")}}})
    floor = {("moga", 0.0): 1.9, ("moga", 0.1): 2.0, ("muon", 0.0): 1.8, ("muon", 0.1): 2.2}
    store_losses(tmp_path, Sweep.from_dict(spec), lambda p: floor[p["optim.name"], p["optim.weight_decay"]]
                 + 0.01 * p["seed"] + 0.1 * (p["optim.lr"] != max(LRS[p["optim.name"]])))
    rows, merged = ablation.merged_ablation([tmp_path])
    entries = ablation.ablation(rows, merged["axes"], scale_key="model.n_embd", against={"optim.name": "muon"})
    ref = entries[0]["reference"]
    assert ref["name"] == "name=muon (weight_decay=0.0)" and ref["lr"] == max(LRS["muon"])
    moga = next(e for e in entries if e["variant"] == {"optim.name": "moga", "optim.weight_decay": 0.0})
    assert moga["reference_loss"] == pytest.approx(1.81) and moga["relative"] == pytest.approx(1.91 / 1.81 - 1)
    with pytest.raises(ValueError, match="model.n_layer.*its choices: optim.name, optim.weight_decay"):
        ablation.ablation(rows, merged["axes"], scale_key="model.n_embd", against={"model.n_layer": 2})
    done = subprocess.run([sys.executable, "-m", "moga.experiments.reproduce.quality", "ablation", str(tmp_path),
                           "--against", "optim.weight_decay=0.1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "vs tuned weight_decay=0.1 (name=moga) [95%]" in done.stdout  # moga is the better of the two at 0.1
