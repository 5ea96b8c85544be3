"""The tune claim's judge, recomputed from stored cells: held, failed and undecided on known curves."""

from moga.experiments.reproduce.tune_claim import regret_of, target_fields


def cells(losses: dict[float, list[float]]) -> list[dict]:
    return [{"lr": lr, "seed": s, "status": "finished", "train_loss": v}
            for lr, values in losses.items() for s, v in enumerate(values)]


CURVE = cells({0.05: [1.100, 1.104, 1.097], 0.1: [1.000, 1.003, 0.998], 0.2: [1.101, 1.099, 1.105]})


def entry(rate, data):
    return {"tune": {"rate": rate, "flops": {"saved": 0.9}, "why": []}, "target": {"label": "256x8"},
            "proxies": [{"label": "16x2"}, {"label": "32x2"}], "cells": data}


def test_the_suggested_rate_at_the_targets_optimum_holds_and_one_step_off_fails():
    at = regret_of(CURVE, 0.1)
    assert at["point"] < 0.001 and at["interval"][1] < 0.02 and at["seeds"] == 3
    off = regret_of(CURVE, 0.2)
    assert off["interval"][0] > 0.02  # one grid step costs ~10% on this curve
    assert target_fields({"gpt": entry(0.1, CURVE)}, 0.02)["outcome"] == "held"
    fields = target_fields({"gpt": entry(0.1, CURVE), "llama": entry(0.2, CURVE)}, 0.02)
    assert fields["outcome"] == "failed" and "[failed] llama" in fields["details"][1]


def test_an_optimum_on_the_targets_edge_is_undecided():
    edge = cells({0.05: [1.2, 1.21], 0.1: [1.1, 1.11], 0.2: [1.0, 1.01]})
    assert regret_of(edge, 0.1)["edge"] == "upper"
    assert target_fields({"gpt": entry(0.1, edge)}, 0.02)["outcome"] == "undecided"
