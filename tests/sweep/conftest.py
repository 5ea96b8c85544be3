"""The store tests' sweep: an lr x depth grid of one optimizer (no optim.name axis) on digits, 2 steps a cell,
settled once per module and copied for each test that changes it."""

import shutil

import pytest

from moga.sweep.spec import Sweep
from moga.sweep.store import SweepStore
from moga.sweep.worker import run_worker

BASE = {
    "seed": 0,
    "model": {"name": "residual_mlp", "width": 8},
    "data": {"name": "digits"},
    "optim": {"name": "muon", "lr": 0.05},
    "train": {"steps": 2, "batch_size": 32},
    "eval": {"every": 0, "train_eval": False, "max_batches": 1},
    "logging": {"progress": False},
}
SPEC = {"base": BASE, "axes": {"optim.lr": [0.05, 0.1], "model.depth": [1, 2]}, "scale_key": "model.depth"}


@pytest.fixture(scope="module")
def settled(tmp_path_factory) -> SweepStore:
    """:data:`SPEC`'s four cells, worked in this process: read it, never change it."""
    store = SweepStore(tmp_path_factory.mktemp("settled") / "sweep")
    store.create_or_check(Sweep.from_dict(SPEC))
    assert run_worker(store.dir) == 4
    return store


@pytest.fixture
def settled_copy(settled, tmp_path) -> SweepStore:
    """A copy of :func:`settled` for one test to change."""
    shutil.copytree(settled.dir, tmp_path / "sweep")
    return SweepStore(tmp_path / "sweep")
