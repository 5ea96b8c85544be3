"""`moga sweep --seeds`: a user's own sweep gets seeds where its transfer decision is close, on the same store."""

from collections import Counter

import yaml
from typer.testing import CliRunner

from moga.cli import app
from moga.sweep.report import analyze
from moga.sweep.results import records
from moga.sweep.seeds import decisive_lrs
from moga.sweep.store import SweepStore

BASE = {
    "seed": 0,
    "model": {"name": "residual_mlp", "width": 16, "depth_scaling": "inverse_depth"},
    "data": {"name": "digits"},
    "optim": {"name": "moga"},
    "schedule": {"name": "cosine", "warmup_fraction": 0.1},
    "train": {"steps": 12, "batch_size": 32},
    "eval": {"every": 0, "train_eval": False, "final_window": 4},
    "checkpoint": {"every": 6},
    "logging": {"progress": False},
}
LRS = [2.0 ** k for k in range(-3, 2)]
OWN = {"model.depth": 1, "optim.lr": LRS[0], "seed": 7}  # the user's own extra cell stays


def write(tmp_path, **extra):
    path = tmp_path / "sweep.yaml"
    spec = {"base": BASE, "axes": {"model.depth": [1, 2], "optim.lr": LRS}, "include": [OWN], **extra}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_seeds_are_added_on_every_decisive_rate_and_a_rerun_adds_nothing(tmp_path):
    args = ["sweep", str(write(tmp_path, scale_key="model.depth")), "-o", str(tmp_path / "out"), "-q", "-w", "2",
            "--seeds", "2", "--max-seeds", "2", "--by", "optimizer"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    store = SweepStore(tmp_path / "out")
    rows = records(store)
    seeds = Counter((r["model.depth"], r["optim.lr"]) for r in rows)
    assert seeds[(1, LRS[0])] >= 2 and any(r["seed"] == 7 for r in rows)  # the user's include is kept
    (panel,) = analyze(rows, scale_key="model.depth", group_keys=("optimizer",), max_regret=0.02)
    decisive = decisive_lrs(panel)
    assert panel.decision is not None and decisive, panel  # these rates put both optima inside the grid
    for depth, lrs in decisive.items():
        for lr in lrs:
            have = {r["seed"] for r in rows if r["model.depth"] == depth and r["optim.lr"] == lr}
            assert {0, 1} <= have, (depth, lr, have)
    elsewhere = [k for k in seeds if k[1] not in decisive[k[0]] and k != (1, LRS[0])]
    # seeds go where the decision is (an earlier round's argmin may have been elsewhere), not everywhere
    assert any(seeds[k] == 1 for k in elsewhere), seeds
    before = len(store.events())
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert len(records(store)) == len(rows) and len(store.events()) == before  # resumed: nothing ran


def test_a_panel_whose_optimum_sits_on_the_grid_edge_gets_no_seeds_and_the_run_says_so(tmp_path):
    """Seeds on an edge optimum would pin down a rate the grid has not bracketed: none are added, and the one line
    names the panel and the edge instead of staying silent."""
    path = tmp_path / "sweep.yaml"
    small = {"base": BASE, "axes": {"model.depth": [1, 2], "optim.lr": LRS[:2]}, "scale_key": "model.depth"}
    path.write_text(yaml.safe_dump(small, sort_keys=False))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["sweep", str(path), "-o", str(out), "-q", "-w", "1", "--seeds", "2",
                                      "--max-seeds", "2", "--by", "optimizer"])
    assert result.exit_code == 0, result.output
    rows = records(SweepStore(out))
    (panel,) = analyze(rows, scale_key="model.depth", group_keys=("optimizer",), max_regret=0.02)
    assert panel.decision is None and "edge" in panel.verdict_line, panel.verdict_line  # the premise
    assert {r["seed"] for r in rows} == {0}  # no seeds added
    assert f"no seeds added to {panel.title}: {panel.verdict_line}" in " ".join(result.output.split())
