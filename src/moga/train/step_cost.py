"""A training step's cost, timed side by side: each config's step (forward and backward, the optimizer's step,
zero_grad, as the engine takes it) in turns, ``steps`` steps per config per round, so that what else the machine
does falls on every config alike. A comparison reads the median of per-round ratios, as ``moga bench`` does:
run times of a sweep's cells, which ran at different times beside different jobs, compare loosely.

On a CPU with one thread the clock is the process's CPU time (another job on the machine does not count);
otherwise the wall clock, after a device synchronize.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from .config import RunConfig, as_config
from .distributed import Dist, pick_device
from .engine import Trainer


def step_seconds(configs: dict[str, RunConfig | dict], rounds: int = 21, steps: int = 10, warmup: int = 1,
                 threads: int | None = None) -> dict:
    """{"seconds": {name: [seconds per step, one per round]}, "clock", "threads", "device", "rounds", "steps"}.
    ``threads``: torch's intra-op threads while timing (the sweep workers' count; None: as set now). Each
    config is set up in one process, from its initial weights, with no run directory; ``warmup`` rounds are
    left out (first calls allocate and pick kernels)."""
    if rounds < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"rounds and steps must be >= 1 and warmup >= 0, got {rounds}, {steps}, {warmup}")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            trainers = {name: trainer_for_timing(cfg, Path(scratch) / str(i))
                        for i, (name, cfg) in enumerate(configs.items())}
            devices = {t.dist.device.type for t in trainers.values()}
            one_cpu_thread = devices == {"cpu"} and torch.get_num_threads() == 1
            now = time.process_time if one_cpu_thread else time.perf_counter
            sync = torch.cuda.synchronize if "cuda" in devices else (lambda: None)  # a GPU step ends with its kernels
            seconds: dict[str, list[float]] = {name: [] for name in trainers}
            for r in range(warmup + rounds):
                for name, trainer in trainers.items():  # take turns, so noise is shared
                    sync()
                    start = now()
                    trainer.steps_untracked(steps)
                    sync()
                    if r >= warmup:
                        seconds[name].append((now() - start) / steps)
            return {"seconds": seconds, "clock": "cpu" if one_cpu_thread else "wall",
                    "threads": torch.get_num_threads(), "device": ",".join(sorted(devices)), "rounds": rounds,
                    "steps": steps}
    finally:
        torch.set_num_threads(previous)


def trainer_for_timing(cfg: RunConfig | dict, scratch: Path) -> Trainer:
    """A trainer set up in one process at step 0, for :meth:`Trainer.steps_untracked`; ``scratch`` (a directory that
    need not exist) is neither read nor written. A branched cooldown's config starts from its initial weights:
    its step costs what its source's does."""
    cfg = as_config(cfg)
    if cfg.train.parallel in ("ddp", "fsdp"):
        raise ValueError(f"step_seconds times one process; train.parallel={cfg.train.parallel!r} needs torchrun")
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"branch_from": None, "parallel": "none"})})
    trainer = Trainer(cfg, scratch, Dist(device=pick_device(cfg.train.device)), quiet=True)
    trainer._setup()
    trainer.model.train()
    return trainer
