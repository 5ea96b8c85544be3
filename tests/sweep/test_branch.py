"""A sweep's warmup-stable-decay budgets branch from its longest run: the same numbers as running each from step 0."""

import pytest

from moga.sweep.branch import Branches
from moga.sweep.executor import run_sweep
from moga.sweep.spec import Sweep, cell_id
from moga.sweep.store import SweepStore
from moga.train import read_metrics

BASE = {
    "seed": 0,
    "model": {"name": "residual_mlp", "width": 16, "depth": 2},
    "data": {"name": "digits"},
    "optim": {"name": "moga", "lr": 0.1, "weight_decay": 0.1},
    "schedule": {"name": "wsd", "warmup_steps": 2, "decay_fraction": 0.2},
    "train": {"steps": 10, "batch_size": 32},
    "eval": {"every": 0, "train_eval": False},
    "checkpoint": {"every": 3},
    "logging": {"progress": False, "log_every": 1},
}
BUDGETS = [10, 20, 40]  # decay starts 8, 16 and 32


def sweep(base=BASE, budgets=BUDGETS, **extra) -> Sweep:
    axes = {"optim.lr": [0.05, 0.1], "train.steps": budgets}
    return Sweep.from_dict({"base": base, "axes": axes, "scale_key": "train.steps", **extra})


def strip(result: dict) -> dict:
    """A cell's result but for how long it took and where it started."""
    return {k: v for k, v in result.items() if k not in ("wall_time_s", "branched_from")}


def results(store: SweepStore) -> dict:
    return {(c["params"]["optim.lr"], c["params"]["train.steps"]): c for c in store.cells()}


@pytest.mark.parametrize("workers", [1, 2])
def test_branched_budgets_equal_each_budget_run_from_step_0(tmp_path, workers):
    """Every shorter budget starts from the longest run's checkpoint at its decay start (the short cells come
    first in the grid, so a worker passes over them until that checkpoint is there), and ends with the losses it
    ends with from scratch; each checkpoint kept for a branch is gone once the branch is done."""
    run_sweep(sweep(), tmp_path / "branched", workers=workers, progress=False)
    branched = SweepStore(tmp_path / "branched")
    stores = {}
    for steps in BUDGETS:  # one budget per sweep: nothing to branch from
        run_sweep(sweep(budgets=[steps]), tmp_path / f"alone{steps}", workers=1, progress=False)
        stores[steps] = SweepStore(tmp_path / f"alone{steps}")
    alone = {key: c for store in stores.values() for key, c in results(store).items()}
    got = results(branched)
    assert got.keys() == alone.keys()
    for (lr, steps), cell in got.items():
        assert cell["status"] == alone[lr, steps]["status"] == "finished"
        assert strip(cell["result"]) == strip(alone[lr, steps]["result"]), (lr, steps)
        source = got[lr, 40]
        if steps < 40:  # it did branch: its first steps are the source's records, wall-clock times included
            assert cell["result"]["branched_from"] == {"cell": source["id"], "step": steps - steps // 5}
            start = steps - steps // 5
            first = lambda store, c: [r for r in read_metrics(store.cell_dir(c["id"]) / "metrics.jsonl")  # noqa: E731
                                      if r["step"] <= start]
            assert first(branched, cell) == first(branched, source) != first(stores[steps], alone[lr, steps])
        else:
            assert "branched_from" not in cell["result"]
    assert not list((tmp_path / "branched").rglob("checkpoint-*.pt"))


def test_only_a_wsd_budget_axis_with_a_shared_stable_phase_branches(tmp_path):
    plan = lambda s: Branches(s, lambda cid: tmp_path / cid).points  # noqa: E731
    assert plan(sweep()) == {
        cell_id({"optim.lr": lr, "train.steps": steps}): (cell_id({"optim.lr": lr, "train.steps": 40}), steps - steps // 5)
        for lr in (0.05, 0.1) for steps in (10, 20)}
    cosine = {**BASE, "schedule": {"name": "cosine", "warmup_fraction": 0.1}}
    assert plan(sweep(base=cosine)) == {}
    # warmup as a fraction: each budget warms up for its own length, so their first steps differ
    by_fraction = {**BASE, "schedule": {"name": "wsd", "warmup_fraction": 0.1}}
    assert plan(sweep(base=by_fraction)) == {}
    # another setting per budget (an override selected by train.steps) is another run, not a branch
    other = {"optim.momentum": {"by": "train.steps", "values": {"10": 0.9, "20": 0.95, "40": 0.95}}}
    assert sorted(step for _, step in plan(sweep(overrides=other)).values()) == [16, 16]


def test_a_branch_waits_for_its_source_only_while_the_source_can_still_write_its_checkpoint(tmp_path):
    branches = Branches(sweep(), lambda cid: tmp_path / cid)
    short = cell_id({"optim.lr": 0.1, "train.steps": 10})
    source = cell_id({"optim.lr": 0.1, "train.steps": 40})
    assert branches.points[short] == (source, 8)
    for status, waits in (("pending", True), ("running", True), ("failed", False), ("diverged", False)):
        assert branches.waits(short, {source: status}) is waits
    assert branches.config({"optim.lr": 0.1, "train.steps": 10}).train.branch_from is None  # runs from step 0
    assert branches.config({"optim.lr": 0.1, "train.steps": 40}).checkpoint.keep == [8, 16]
    (tmp_path / source).mkdir()
    (tmp_path / source / "checkpoint-8.pt").write_bytes(b"")
    assert not branches.waits(short, {source: "running"})
    assert branches.config({"optim.lr": 0.1, "train.steps": 10}).train.branch_from == str(
        tmp_path / source / "checkpoint-8.pt")
