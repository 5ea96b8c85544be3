"""End to end on a tiny residual MLP on digits: a rate, an interval, snippets; a re-run trains no cell again."""

import json

import pytest
from typer.testing import CliRunner

from moga.cli import app
from moga.experiments.tune import TuneError, tune
from moga.train import load_config

BASE = {"seed": 0, "model": {"name": "residual_mlp", "width": 64, "depth": 4}, "data": {"name": "digits"},
        "optim": {"name": "moga", "preset": "paper"}, "schedule": {"name": "cosine", "warmup_fraction": 0.1},
        "train": {"steps": 40, "batch_size": 32}, "eval": {"every": 0, "train_eval": False, "final_window": 10},
        "checkpoint": {"every": 0}, "logging": {"progress": False}}
LRS = [2.0**k for k in range(-4, 1)]


def test_tune_gives_a_rate_an_interval_and_snippets_and_resumes(tmp_path):
    out = tmp_path / "tune"
    kw = dict(out=out, budget_flops=3e9, proxies=[(16, 2), (32, 2)], lrs=LRS, workers=2, max_seeds=3,
              progress=False, log=lambda line: None)
    first = tune(BASE, **kw)
    assert first["cells_trained"] == first["flops"]["cells"] > 2 * len(LRS)  # the grid and the seeds
    assert first["flops"]["tuning"] <= 3e9 and 0 < first["flops"]["saved"] < 1
    pred = first["prediction"]
    lo, hi = pred["regret_interval"]
    assert 0 <= lo <= hi and first["rate"] == pytest.approx(2 ** pred["log2_lr"])
    assert min(first["lr_grid"]) < first["rate"] < max(first["lr_grid"])
    assert all(p["seeds"] >= 3 for p in first["proxies"])  # seeds where the decision is close
    cfg = load_config(out / "target.yaml")  # a config moga train runs as it is
    assert (cfg.model.width, cfg.model.depth, cfg.optim.lr) == (64, 4, first["rate"])
    assert cfg.model.depth_scaling == "inverse_depth"
    s = first["snippets"]
    assert "torchrun" in s["torchrun"] and str(out / "target.yaml") in s["moga_train"]
    assert f"lr={first['rate']!r}" in s["pytorch"] and f"learning_rate={first['rate']!r}" in s["hf_trainer"]
    assert "rate for the target" in (out / "tune.md").read_text()

    again = tune(BASE, **kw)
    assert again["cells_trained"] == 0 and again["rate"] == first["rate"]
    assert json.loads((out / "tune.json").read_text())["rate"] == first["rate"]


def test_bad_input_is_one_line_on_the_command_line(tmp_path):
    config = tmp_path / "base.json"
    config.write_text(json.dumps(BASE))
    runner = CliRunner()
    cases = [(["--model", "resnet", "--budget-flops", "1e12"], "has no width and depth knobs"),
             (["--budget-flops", "1e6"], "too small for two proxies"),
             (["--budget-flops", "1e12", "--proxies", "128x2"], "is not larger than proxy 128x2"),
             (["--budget-flops", "1e12", "--model", str(tmp_path / "gpt2.json")], "cannot scale this Hugging Face")]
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    for args, message in cases:
        result = runner.invoke(app, ["tune", str(config), "-o", str(tmp_path / "out"), *args])
        assert result.exit_code == 2, result.output
        assert message in result.output and result.output.count("error:") == 1
        assert not (tmp_path / "out" / "sweep.db").exists()  # nothing ran


def test_no_budget_is_refused():
    with pytest.raises(TuneError, match="give a tuning budget"):
        tune(BASE, out="unused", progress=False, log=lambda line: None)
