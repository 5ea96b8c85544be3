"""moga.train.step_cost: the step it times is the step that trains, taken in turns, on the clock it names."""

import pytest
import torch

from moga.train.config import as_config
from moga.train.distributed import Dist
from moga.train.engine import Trainer
from moga.train.step_cost import step_seconds, trainer_for_timing

from .conftest import same_tensors, tiny

CONSTANT = {"schedule": {"name": "constant"}, "train": {"steps": 3}, "eval": {"every": 0}}


def test_the_timed_steps_are_the_training_steps(tmp_path):
    """Three timed steps leave the model and the optimizer where three steps of training do (a constant rate:
    the timing leaves the step counter, and so the schedule, where it is)."""
    for optim in ({"name": "moga", "lr": 0.05}, {"name": "muon", "lr": 0.02}):
        cfg = tiny(**CONSTANT, optim=optim)
        trained = Trainer(as_config(cfg), tmp_path / optim["name"], Dist())
        trained.fit()
        timed = trainer_for_timing(cfg, tmp_path / "scratch")
        timed.steps_untracked(3)
        assert timed.step == 0
        assert same_tensors(timed.model.state_dict(), trained.model.state_dict()), optim
        assert same_tensors(timed.optimizer.state_dict()["state"], trained.optimizer.state_dict()["state"]), optim
        assert not (tmp_path / "scratch").exists()  # nothing written


def test_step_seconds_takes_turns_and_names_its_clock():
    configs = {"narrow": tiny(), "wide": tiny(model={"width": 64})}
    before = torch.get_num_threads()
    one = step_seconds(configs, rounds=2, steps=1, warmup=0, threads=1)
    assert list(one["seconds"]) == ["narrow", "wide"] and all(len(v) == 2 for v in one["seconds"].values())
    assert all(s > 0 for v in one["seconds"].values() for s in v)
    # one CPU thread: the process's CPU time, which another job on the machine does not add to
    assert (one["clock"], one["threads"], one["device"], one["rounds"], one["steps"]) == ("cpu", 1, "cpu", 2, 1)
    assert torch.get_num_threads() == before
    two = step_seconds(configs, rounds=1, steps=1, warmup=0, threads=2)
    assert (two["clock"], two["threads"]) == ("wall", 2)  # CPU time would add up every thread's
    assert torch.get_num_threads() == before


def test_step_seconds_refuses_what_it_cannot_time():
    with pytest.raises(ValueError, match="times one process; train.parallel='ddp' needs torchrun"):
        step_seconds({"a": tiny(train={"parallel": "ddp"})}, rounds=1, steps=1)
    with pytest.raises(ValueError, match="rounds and steps must be >= 1"):
        step_seconds({"a": tiny()}, rounds=0)
