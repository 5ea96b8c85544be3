"""Why a run stops before its last step: a signal (it checkpoints and can resume), a non-finite gradient (the
step is skipped) or a diverging loss (the run ends with a diverged result)."""

from __future__ import annotations

import math
import signal
import threading

import torch


class StopFlag:
    """SIGTERM / SIGINT set a flag that the loop checks at the next step boundary (main thread only)."""

    def __init__(self):
        self.set, self._old = False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored on purpose (sweep workers: SIGINT)
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.set:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        self.set = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def nonfinite_flag(total_norm: torch.Tensor) -> torch.Tensor:
    """The step's verdict from clipping's global gradient norm, on the device: it is NaN or inf exactly when
    a gradient is (or, for finite gradients, when their norm overflows: a step worth skipping too). A
    DTensor norm (FSDP2) is made whole first: one scalar all-reduce, instead of the optimizer's own."""
    if hasattr(total_norm, "full_tensor"):
        total_norm = total_norm.full_tensor()
    return torch.isfinite(total_norm).logical_not()


def divergence(t, loss: float, first: float | None) -> str | None:
    """Why the run diverged, from its ``train`` config section ``t``: a non-finite loss, one above
    train.loss_ceiling, or one above train.divergence_factor times the first step's loss ``first``; None while it
    has not."""
    if not math.isfinite(loss):
        return "non-finite loss"
    if t.loss_ceiling is not None and loss > t.loss_ceiling:
        return f"loss above train.loss_ceiling={t.loss_ceiling:g}"
    if t.divergence_factor is not None and first is not None and math.isfinite(first) and first > 0 \
            and loss > t.divergence_factor * first:
        return f"loss above train.divergence_factor={t.divergence_factor:g} x the first step's loss {first:.4g}"
    return None
