"""The `moga smoothness` experiments as 2-depth, 2-width miniatures, the report helpers and the diagnostics plot."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from moga.experiments.smoothness.checks import paired_gain
from moga.experiments.smoothness.convergence import constant_rates, convergence_experiment, step_rule_experiment
from moga.experiments.smoothness.report import loglog_slope, spearman, trend
from moga.experiments.smoothness.scaling import depth_experiment, width_experiment


@pytest.fixture(autouse=True)
def float64_by_default():
    """Overrides the package's float64 fixture: the experiments build real models on float32 data. One thread:
    these models are tiny, and OpenMP threads spinning on a shared CPU cost more than they give."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)


def _outputs(out, figure):
    assert (out / figure).stat().st_size > 0
    result = json.loads((out / "results.json").read_text())
    summary = (out / "summary.md").read_text()
    assert "## Verdict" in summary and figure in summary
    return result, summary


def test_slopes_and_trends():
    xs = [2, 4, 8, 16]
    assert loglog_slope(xs, [3 * x**0.5 for x in xs]) == pytest.approx(0.5)
    assert loglog_slope(xs, [1.0, math.nan, None, 0.0]) is None  # one usable point
    assert [trend(s) for s in (0.1, -0.1, 0.3, -0.3, None)] == ["flat", "flat", "growing", "shrinking", "unmeasured"]
    assert spearman([3, 4, 6, 8], [1.0, 2.0, 4.0, 3.0]) == pytest.approx(0.8)
    assert constant_rates({"steepest": 0.1, "lr_at_min": 1.0}, 3) == pytest.approx([0.1, 0.1 * 10**0.5, 1.0])
    assert constant_rates({"steepest": 0.1, "lr_at_min": 0.05}, 2) == pytest.approx([0.05, 0.2])
    assert constant_rates({"steepest": 0.1, "lr_at_min": 0.4}, 1) == [0.4]


def test_depth_miniature(tmp_path, text_file, monkeypatch):
    monkeypatch.setenv("MOGA_TEXT", str(text_file))  # tiny Shakespeare where moga finds it, else the stand-in
    depth_experiment(tmp_path / "d", quick=True, log=lambda s: None)
    result, summary = _outputs(tmp_path / "d", "depth.png")
    rows = result["rows"]
    assert {(r["model"], r["scaling"], r["K"], r["phase"]) for r in rows} == {
        (m, s, k, p) for m in ("residual_mlp", "gpt") for s in ("alpha=1", "alpha=K_base/K") for k in (2, 4)
        for p in ("init", "trained")}
    for r in rows:
        assert r["block"] == "matrix" and r["lipschitz"] > 0 and r["smoothness"] > 0
    # at K = K_base the scaled net is the unscaled one
    same = [r for r in rows if r["K"] == 2 and r["phase"] == "init"]
    for model in ("residual_mlp", "gpt"):
        a, b = (r for r in same if r["model"] == model)
        assert a["smoothness"] == pytest.approx(b["smoothness"]) and a["alpha"] == b["alpha"] == 1.0
    assert len(result["verdicts"]) == 8 and "flat claim" in summary


def test_width_miniature(tmp_path):
    width_experiment(tmp_path / "w", quick=True, log=lambda s: None)
    result, summary = _outputs(tmp_path / "w", "width.png")
    assert {(r["width"], r["geometry"], r["phase"]) for r in result["rows"]} == {
        (w, g, p) for w in (8, 16) for g in ("row", "col", "sign", "spectral") for p in ("init", "trained")}
    init = {r["geometry"]: r for r in result["rows"] if r["width"] == 8 and r["phase"] == "init"}
    assert len({round(r["lipschitz"], 6) for r in init.values()}) == 4  # one gradient, four dual norms
    assert {v["predicted"] for v in result["verdicts"] if v["quantity"] == "smoothness"} == {"flat", "sqrt"}


def test_convergence_and_step_rule_miniatures(tmp_path):
    convergence_experiment(tmp_path / "c", quick=True, log=lambda s: None, seeds=2)
    result, summary = _outputs(tmp_path / "c", "convergence.png")
    (a,) = result["adaptive_vs_constant"]
    assert a["data"] == "digits" and len(a["runs"]) == 2 * 3 and a["held"] in (True, False)
    # the shared-weights depths and the long run repeat on every seed; seed 1 starts at seed 0's constant rate
    runs = result["shared"]["runs"]
    assert [(r["L"], r["seed"]) for r in runs["adaptive"]] == [(2, 0), (3, 0), (2, 1), (3, 1)]
    for L in (2, 3):
        first, second = (next(r for r in runs["constant"] if (r["L"], r["seed"]) == (L, s)) for s in (0, 1))
        assert second["tried"][0]["lr"] == first["optim"]["lr"]
    numbers = result["seed_numbers"]
    assert numbers["deeper_slower"]["constant"]["losses"] == [[r["final_train_loss"] for r in runs["constant"]
                                                                if r["seed"] == s] for s in (0, 1)]
    long = result["long"]["adaptive"]
    assert long["weights"]["frobenius"] and long["rose_last_quarter"] in (True, False)
    assert long["w_first"] > 0 and long["w_end"] > 0  # the diagnostics' Frobenius norm of the one weight tensor
    (later,) = long["seeds"]
    assert later["name"].endswith("-seed1") and later["growth_second_half"] != long["growth_second_half"]
    assert numbers["w_growth"]["adaptive"]["growth"] == [long["growth_second_half"], later["growth_second_half"]]
    assert long["check"]["seeds"] == 2 and "per seed" in summary

    step_rule_experiment(tmp_path / "s", quick=True, log=lambda s: None)
    result, summary = _outputs(tmp_path / "s", "steprule.png")
    assert result["measured_L"] > 0 and len(result["comparison"]) == 3
    running = result["rule_runs"]["running L (max)"]
    cap = result["settings"]["cap"]
    assert all(0 < lr <= cap for lr in running["curve"]["lr"]) and min(running["curve"]["lr"]) < cap
    assert "vs the best constant" in summary


def test_paired_gain_decides_only_outside_its_interval():
    # best constant - adaptive per seed: a clear win, a clear loss, a straddle
    win = paired_gain([1.0, 1.1, 0.9], {0.1: [1.2, 1.31, 1.12], 0.3: [1.5, 1.6, 1.4]})
    assert win["best_constant_lr"] == 0.1 and win["verdict"] == "held" and win["seeds"] == 3
    assert win["difference"] == pytest.approx(0.21) and 0 < win["low"] < 0.21 < win["high"]
    lost = paired_gain([1.0, 1.1, 0.9], {0.1: [0.8, 0.92, 0.69]})
    assert lost["verdict"] == "failed" and lost["high"] < 0
    # mean +0.033 but the seeds disagree: the t interval (4.30 * sd / sqrt 3) straddles 0
    straddle = paired_gain([1.0, 1.1, 0.9], {0.1: [1.1, 1.05, 0.95]})
    assert straddle["difference"] > 0 and straddle["low"] < 0 < straddle["high"]
    assert straddle["verdict"] == "inconclusive"
    # one seed has no interval, however large the gap
    assert paired_gain([1.0], {0.1: [2.0]})["verdict"] == "inconclusive"
    # the best constant is the lowest seed mean, compared seed by seed (paired), not each seed's best
    assert paired_gain([1.0, 1.0], {0.1: [0.5, 3.0], 0.2: [1.2, 1.3]})["best_constant_lr"] == 0.2
    # a diverged seed: decided only when every seed agrees
    assert paired_gain([1.0, 1.0], {0.1: [math.inf, 1.5]})["verdict"] == "held"
    assert paired_gain([math.inf, 1.0], {0.1: [1.2, 1.5]})["verdict"] == "inconclusive"


def _stamps(out):
    """Each run file's modification time (not the lock files, which every call opens)."""
    return {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*") if p.is_file() and not p.name.startswith(".")}


def test_convergence_seeds_are_new_runs_and_cached(tmp_path):
    out, quiet = tmp_path / "c", (lambda s: None)
    convergence_experiment(out, quick=True, log=quiet, shared_depths=[])
    one = _stamps(out)
    convergence_experiment(out, quick=True, log=quiet, shared_depths=[], seeds=2)
    two = _stamps(out)
    assert {p: two[p] for p in one} == one  # seed 0's runs are the cached ones, untouched
    dirs = [d.name for d in (out / "runs").iterdir()]  # adaptive and 2 constant rates, on seeds 0 and 1
    assert len(dirs) == 6 and sum("-seed1-" in d for d in dirs) == 3
    result = json.loads((out / "results.json").read_text())
    (a,) = result["adaptive_vs_constant"]
    assert a["gain"]["seeds"] == 2 and len(a["runs"]) == 6
    by_name = {r["name"]: r for r in a["runs"]}
    assert by_name["ff-digits-adaptive"]["final_train_loss"] != by_name["ff-digits-adaptive-seed1"]["final_train_loss"]
    for lr in a["constant_rates"]:  # the same rates on both seeds
        assert {by_name[f"ff-digits-constant-{lr:.3g}{s}"]["optim"]["lr"] for s in ("", "-seed1")} == {lr}
    assert a["verdict"] in ("held", "failed", "inconclusive") and "paired seeds" in (out / "summary.md").read_text()
    convergence_experiment(out, quick=True, log=quiet, shared_depths=[], seeds=2)
    assert _stamps(out) == two  # nothing ran again


def test_cli_runs_an_experiment_and_plots_diagnostics(tmp_path):
    from moga.experiments.smoothness.cli import smoothness_command
    from moga.train import run

    import typer

    app = typer.Typer(add_completion=False)
    app.command("smoothness")(smoothness_command)
    app.command("other")(lambda: None)  # two commands, so the name 'smoothness' is on the command line
    runner = CliRunner()
    out = runner.invoke(app, ["smoothness", "width", "--quick", "-o", str(tmp_path / "w"), "--json"])
    assert out.exit_code == 0, out.output
    assert "== width" in out.output and "predicted flat" in out.output and '"experiment": "width"' in out.output

    cfg = {"model": {"name": "residual_mlp", "width": 8, "depth": 2}, "data": {"name": "digits"},
           "train": {"steps": 4, "batch_size": 32}, "logging": {"progress": False, "diagnostics_every": 2}}
    run(cfg, tmp_path / "run")
    out = runner.invoke(app, ["smoothness", "diagnostics", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "run" / "diagnostics.png").stat().st_size > 0
    bad = runner.invoke(app, ["smoothness", "depht"])
    assert bad.exit_code == 2 and "experiment must be one of" in bad.output


def test_example_configs_build():
    from pathlib import Path

    from moga.train import load_config
    from moga.train.build import build_optimizer, model_from_config

    paths = sorted((Path(__file__).resolve().parents[3] / "configs" / "smoothness").glob("*.yaml"))
    assert paths
    for path in paths:
        cfg = load_config(path)
        assert cfg.optim.step_rule == "depth_paper" and cfg.logging.diagnostics_every > 0
        build_optimizer(cfg, model_from_config(cfg, {"in_features": 784, "out_features": 10}))
