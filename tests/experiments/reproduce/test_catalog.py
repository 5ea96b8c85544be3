"""Every reproduction's grids, at every scale, expand into valid training configs, without training."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from moga.experiments.reproduce.catalog import SCALES, catalog, cell_cost, data_inputs, get, merge
from moga.sweep.spec import arm_label
from moga.train.build import build_optimizer, model_from_config

NAMES = ["depth-mlp", "depth-gpt", "depth-resnet", "width-gpt", "width-mlp", "race", "convergence", "joint", "quality",
         "gap-width", "tune"]


def test_the_issue_names_every_reproduction():
    assert list(catalog()) == NAMES
    for rep in catalog().values():
        assert rep.paper and rep.figure and rep.claim
        assert rep.kind in ("race", "convergence", "quality", "gap", "tune") or rep.expect, f"{rep.name} claims nothing about any panel"
        paper = rep.scale("paper")
        assert paper.get("source") and paper.get("silent"), f"{rep.name}: say where the paper scale comes from"


@pytest.mark.parametrize("scale", SCALES)
def test_every_cell_of_every_grid_builds_its_model_and_optimizer(scale):
    """The paper scale too: each distinct model and optimizer is built on the meta device (no memory)."""
    for rep in catalog().values():
        if rep.kind == "convergence":
            from moga.experiments.smoothness.convergence import convergence_settings

            convergence_settings(**rep.settings(scale))  # unknown settings raise
            continue
        if rep.kind == "tune":  # its targets, each on the meta device (moga tune builds its proxies)
            from moga.experiments.reproduce.catalog import tune_settings
            from moga.train.config import build_config
            s = tune_settings(rep, scale)
            for target in s["targets"].values():
                # depth scaling needs a probe forward, which meta tensors cannot run: built without it here
                config = build_config(merge(copy.deepcopy(s["base"]), {"model": {**target["model"],
                                                                                 "depth_scaling": "none"}}))
                with torch.device("meta"):
                    build_optimizer(config, model_from_config(config, data_inputs(config)[0]))
            continue
        sweep = rep.sweep(scale)  # expands the grid and validates every cell's config
        models, optimizers = {}, set()
        for cell in sweep.cells:  # every distinct model once, every distinct optimizer once on one of them
            config = sweep.config(cell)
            key = config.model.model_dump_json()
            if key not in models:
                with torch.device("meta"):
                    models[key] = model_from_config(config, data_inputs(config)[0])
            optim = config.optim.model_dump_json(exclude={"lr"})
            if optim not in optimizers:
                optimizers.add(optim)
                build_optimizer(config, models[key])
        seen = models
        assert seen, rep.name


@pytest.mark.parametrize("scale", SCALES)
def test_every_reproduction_runs_moga_as_the_paper_did(scale):
    """Each MOGA cell pins optim.preset: paper, so a change of MOGA's default cannot change what a reproduction runs;
    the race also races MOGA's default and the muoneq preset, by name, beside it (issue 35), and its store records
    what the default ran."""
    pinned = 0
    for rep in catalog().values():
        if rep.kind == "tune":
            from moga.experiments.reproduce.catalog import tune_settings
            assert tune_settings(rep, scale)["base"]["optim"]["preset"] == "paper"
            continue
        if rep.kind == "convergence":
            continue
        sweep = rep.sweep(scale)
        for cell in sweep.cells:
            config = sweep.config(cell)
            if config.optim.name == "moga":
                allowed = ("paper", "default", "muoneq") if rep.name == "race" else ("paper",)
                assert config.optim.preset in allowed, (rep.name, cell)
                pinned += 1
    assert pinned


@pytest.mark.parametrize("scale", SCALES)
def test_every_transfer_claim_runs_the_papers_muon(scale):
    """Muon as the papers define it, (2, mean) -> (2, mean) on every matrix: moga's all-geometry Muon, which the
    claims' Muon lr grids were chosen for and their stored outcomes measured; named so in their outcomes."""
    with_muon = set()
    for rep in catalog().values():
        if rep.kind not in ("transfer", "joint"):
            continue
        sweep = rep.sweep(scale)
        for cell in sweep.cells:
            optim = sweep.config(cell).optim
            if optim.name == "muon":
                assert optim.preset == "moga" and arm_label(optim) == "muon (moga preset)", (rep.name, cell)
                with_muon.add(rep.name)
    assert with_muon == ({"depth-mlp"} if scale == "quick" else {"depth-mlp", "depth-gpt", "width-mlp", "width-gpt"})


def test_paper_scale_is_the_papers_setup():
    gpt = get("depth-gpt").sweep("paper")
    assert gpt.spec.axes["model.n_layer"] == [2, 4, 8, 16, 32, 64, 128]
    assert {c["optim.lr"] for c in gpt.cells} == {0.001, 0.002, 0.004, 0.01, 0.02, 0.04}
    assert {c["optim.p"] for c in gpt.cells if c["optim.name"] == "moga"} == {1.5, 2.0, 2.5}
    base = gpt.base
    assert (base["model"]["n_embd"], base["model"]["n_head"], base["train"]["steps"], base["train"]["batch_size"]) == (
        256, 4, 1200, 256)
    assert base["schedule"] == {"name": "cosine", "warmup_fraction": 0.1, "min_lr_ratio": 0.1}
    assert len(gpt.cells) == 7 * 5 * 6

    resnet = get("depth-resnet").sweep("paper")
    assert resnet.base["data"]["name"] == "cifar100" and resnet.base["data"]["val_size"] == 5000
    assert (resnet.base["train"]["epochs"], resnet.base["train"]["batch_size"]) == (20, 64)
    assert resnet.base["schedule"] == {"name": "cosine", "warmup_epochs": 1, "min_lr_ratio": 0.5}
    assert resnet.spec.axes["model.stages"] == ["resnet18", "resnet34", "resnet66"]
    assert resnet.spec.axes["optim.lr"] == [0.0004, 0.001, 0.002, 0.004, 0.01, 0.02]
    # K = 8, 16, 32 residual blocks: the scale of the report
    assert get("depth-resnet").raw["scale_values"]["model.stages"] == {"resnet18": 8, "resnet34": 16, "resnet66": 32}


def test_quick_and_cpu_scales_fit_their_budgets():
    from moga.experiments.reproduce.catalog import estimate

    for rep in catalog().values():  # a claim that needs more says so, and why, in its cpu scale's budget_minutes
        assert estimate(rep, "quick")["seconds"] < 120, rep.name
        budget = rep.scale("cpu").get("budget_minutes", 30)
        assert estimate(rep, "cpu")["seconds"] < budget * 60, rep.name


def test_cost_counts_parameters_and_tokens():
    sweep = get("depth-gpt").sweep("cpu")
    cell = next(c for c in sweep.cells if c["model.n_layer"] == 2)
    cost = cell_cost(sweep.config(cell))
    d = 128
    blocks = 2 * 12 * d * d  # attention 4 d^2 and MLP 8 d^2 per block (plus biases and norms)
    assert blocks < cost["params"] < blocks + 2 * 65 * d + 64 * d + 20 * d + 10_000
    tokens = 8 * 64 * 100
    assert cost["flops"] == pytest.approx(6 * cost["params"] * tokens + 12 * 2 * 64 * d * tokens)
    assert math.isfinite(cost["seconds"]) and cost["steps"] == 100


def test_merge_replaces_axes_whole_and_data_is_chosen():
    merged = merge({"axes": {"a": {"by": "x", "values": {"p": [1], "q": [2]}}}, "base": {"m": {"w": 1, "d": 2}}},
                   {"axes": {"a": {"by": "x", "values": {"p": [3]}}}, "base": {"m": {"w": 5}}})
    assert merged == {"axes": {"a": {"by": "x", "values": {"p": [3]}}}, "base": {"m": {"w": 5, "d": 2}}}
    assert get("depth-mlp").sweep("cpu", data="cifar10").base["data"]["name"] == "cifar10"
    assert get("depth-mlp").sweep("quick").base["data"]["name"] == "digits"


def test_seed_estimate_brackets_the_seeds_a_stored_reproduction_added():
    """depth-mlp's stored CPU outcome: the grid ran one seed per cell, the decision added the rest."""
    from moga.experiments.reproduce.catalog import estimate

    stored = json.loads((Path(__file__).parents[3] / "docs/reproduce/cpu/depth-mlp.json").read_text())
    e = estimate(get("depth-mlp"), "cpu")
    added = len(stored["cells"]) - e["cells"]
    assert e["cells"] == sum(c["seed"] == 0 for c in stored["cells"])
    lo, hi = e["seed_cells"]
    assert lo <= added <= hi, (lo, added, hi)
    assert 0 < e["seed_seconds"][0] < e["seed_seconds"][1]


def test_seed_estimate_follows_the_seed_options_and_the_kind():
    from moga.experiments.reproduce.catalog import estimate

    one = estimate(get("depth-mlp"), "cpu", min_seeds=1, max_seeds=1)
    assert one["seed_cells"] == (0, 0) and one["seed_seconds"] == (0.0, 0.0)
    assert estimate(get("quality"), "cpu")["seed_cells"] == (0, 0)  # its grid has the seeds
    assert estimate(get("convergence"), "cpu")["seed_cells"] == (0, 0)
