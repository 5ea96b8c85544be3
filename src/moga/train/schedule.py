"""Learning-rate schedules as one pure function of the step, nanoGPT's ``get_lr(it)``.

Being a function of ``it`` alone, a schedule needs no state in a checkpoint: the step is enough.
The papers' two variants are both ``cosine``:
GPT (depth paper): 10% linear warmup, cosine to 0.1 x peak -> warmup_fraction=0.1, min_lr_ratio=0.1;
ResNet: one epoch of warmup, cosine to 0.5 x peak -> warmup_epochs=1, min_lr_ratio=0.5.

``wsd`` (warmup-stable-decay) holds the peak after warmup and decays linearly to ``min_ratio`` over the last
``decay`` steps. Its stable phase does not depend on the run's length, so runs of several budgets at one lr
share it step for step: each budget's run is the longest one's, branched at its decay start and cooled down
(the end-of-run losses of every budget from one stable run, as the race reads them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


SCHEDULES = ("constant", "cosine", "warmup_constant", "wsd")


@dataclass(frozen=True)
class Schedule:
    """lr(it) = peak * factor(it), for steps it = 0 .. total-1.

    Warmup (``warmup`` steps) is linear, ``(it + 1) / (warmup + 1)`` as in nanoGPT, so the first step
    is not wasted at lr 0. ``cosine`` then falls from 1 to ``min_ratio``, reaching it exactly at the
    last step; ``constant`` and ``warmup_constant`` stay at 1.
    """

    name: str = "constant"
    total: int = 1
    warmup: int = 0
    min_ratio: float = 0.1
    decay: int = 0  # wsd: the decay's length in steps, the last of the run

    def __post_init__(self):
        if self.name not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.name!r}")
        if self.total < 1 or not 0 <= self.warmup <= self.total:
            raise ValueError(f"need 0 <= warmup ({self.warmup}) <= total ({self.total}) and total >= 1")
        if self.warmup + self.decay > self.total or self.decay < 0:
            raise ValueError(f"warmup ({self.warmup}) and decay ({self.decay}) steps do not fit in {self.total}")

    def factor(self, it: int) -> float:
        if it < self.warmup:
            return (it + 1) / (self.warmup + 1)
        if self.name == "wsd":
            start = self.total - self.decay  # the decay's steps go from the peak down to min_ratio at the last
            return 1.0 if it < start else 1.0 - (1 - self.min_ratio) * (it - start + 1) / self.decay
        if self.name != "cosine":
            return 1.0
        decay_steps = self.total - 1 - self.warmup
        progress = 0.0 if decay_steps <= 0 else min(1.0, (it - self.warmup) / decay_steps)
        return self.min_ratio + 0.5 * (1 - self.min_ratio) * (1 + math.cos(math.pi * progress))

    def get_lr(self, it: int, peak: float) -> float:
        return peak * self.factor(it)


def build_schedule(cfg, total_steps: int, steps_per_epoch: int | None) -> Schedule:
    """From a ScheduleConfig: resolves warmup given in steps, as a fraction, or in epochs."""
    if cfg.warmup_steps is not None:
        warmup = cfg.warmup_steps
    elif cfg.warmup_fraction is not None:
        warmup = round(cfg.warmup_fraction * total_steps)
    elif cfg.warmup_epochs is not None:
        if not steps_per_epoch:
            raise ValueError("schedule.warmup_epochs needs data with epochs; give warmup_steps or warmup_fraction")
        warmup = round(cfg.warmup_epochs * steps_per_epoch)
    else:
        warmup = 0
    if warmup > total_steps:
        raise ValueError(f"warmup of {warmup} steps is longer than the run ({total_steps} steps)")
    decay = round(cfg.decay_fraction * total_steps) if cfg.name == "wsd" else 0
    if warmup + decay > total_steps:
        raise ValueError(f"warmup ({warmup} steps) and decay ({decay} steps) are longer than the run "
                         f"({total_steps} steps)")
    return Schedule(cfg.name, total_steps, warmup, cfg.min_lr_ratio, decay)
