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

