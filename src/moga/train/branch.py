"""A cooldown branched from another run's checkpoint: one warmup-stable-decay run serves several budgets.

Under ``schedule.name: wsd`` every budget's run holds the peak rate until its own decay starts, so a shorter
budget's run is the longer one's up to there, step for step. ``checkpoint.keep: [s, ...]`` makes the long
run keep its checkpoint at each step ``s`` (``checkpoint-<s>.pt``), and a run with ``train.branch_from`` set to
one of them starts there instead of at step 0: the same weights, optimizer state, data position and random
state that its own first ``s`` steps would have made. It is accepted only when that is true: the source's
config equals this one but for the run's length (and the keys no run's numbers depend on), and the two
schedules give the same rate at every step before ``s``. Its metrics begin with the source's first ``s``
steps', and its time with theirs, so its result reads as the run from scratch would.
"""

from __future__ import annotations

from pathlib import Path

from moga.files import write_bytes

from .checkpoint import CheckpointError, load_checkpoint
from .hashing import config_diff


def branch_state(cfg, run_dir: Path, metrics_name: str) -> dict:
    """The state to start from: ``cfg.train.branch_from``'s, checked; copies the source's metrics up to it."""
    path = Path(cfg.train.branch_from)
    state = load_checkpoint(path)
    source, mine = state["config"], cfg.to_dict()
    differ = config_diff({**source, "train": {**source["train"], "steps": mine["train"]["steps"]}}, mine)
    if differ:
        raise CheckpointError(f"train.branch_from={path} comes from another config, not this one at another length: "
                              + "; ".join(differ))
    metrics = path.parent / metrics_name
    if metrics.is_file():
        write_bytes(run_dir / metrics_name, metrics.read_bytes()[:state["metrics_bytes"]])
    return state


def check_branch_schedule(schedule, state: dict) -> None:
    """The source ran the rates this run would have run before the branch point, or the branch is refused."""
    from .schedule import Schedule

    s = state["schedule"]
    source = Schedule(s["name"], s["total"], s["warmup"], s.get("min_ratio", schedule.min_ratio), s.get("decay", 0))
    step = int(state["step"])
    if any(source.factor(it) != schedule.factor(it) for it in range(step)):
        raise CheckpointError(f"train.branch_from: the source's schedule ({source}) and this run's ({schedule}) give "
                              f"different rates before step {step}: branch at or before this run's decay start")
