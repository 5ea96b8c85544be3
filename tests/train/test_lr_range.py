"""Smith's learning-rate range test, and the paper's restart variant."""

import json
import math

import pytest

from moga.train import lr_range_test
from moga.train.lr_range import smooth_losses, suggest_lr

from .conftest import tiny


def test_sweep_finds_a_rate_between_too_small_and_divergent(tmp_path):
    cfg = tiny(optim={"name": "sgd", "lr": 0.1})
    result = lr_range_test(cfg, tmp_path, lr_min=1e-4, lr_max=100.0, steps=60)
    assert (tmp_path / "lr_range.png").stat().st_size > 1000
    stored = json.loads((tmp_path / "lr_range.json").read_text())
    assert stored["suggestion"] == result["suggestion"]
    lrs = result["lrs"]
    assert lrs[0] == pytest.approx(1e-4) and all(b > a for a, b in zip(lrs, lrs[1:]))
    assert len(lrs) < 60  # SGD at lr ~ 100 blows up, which ends the sweep early
    s = result["suggestion"]
    assert 1e-3 < s["steepest"] < s["lr_at_min"] < 100
    assert s["min_div10"] == pytest.approx(s["lr_at_min"] / 10)
    assert result["suggested_lr"] == s["steepest"]


def test_restart_mode_trains_each_rate_from_the_same_start(tmp_path):
    cfg = tiny(optim={"name": "adaptive-gd"})
    cfg["model"] = {"name": "feedforward", "width": 16, "depth": 3, "activation": "gelu"}
    result = lr_range_test(cfg, tmp_path, lr_min=1e-3, lr_max=1e3, mode="restart", num_lrs=4, steps_per_lr=5)
    assert result["steps_per_lr"] == 5 and len(result["losses"]) == 4
    assert result["losses"][0] > result["losses"][2]  # alpha = 1e-3 barely moves; alpha = 10 does
    assert (tmp_path / "lr_range.png").exists()


def test_smoothing_and_suggestion_helpers():
    assert smooth_losses([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])  # bias-corrected from the start
    lrs = [10 ** (i / 4) for i in range(-12, 5)]
    losses = [1 / (1 + math.exp(4 * (math.log10(lr) + 1))) + (0.5 if lr > 3 else 0) for lr in lrs]
    s = suggest_lr(lrs, losses)
    assert s["steepest"] == pytest.approx(0.1, rel=0.5)
    assert suggest_lr([1, 2], [1.0, 0.5])["steepest"] is None
