"""Synthetic sweeps whose optima are known: loss = floor + curvature * (log2 lr - optimum)^2.

Three noise-free seeds by default: their spread is zero, so the decision's intervals are points and the
verdicts are decided (one seed would leave every verdict inconclusive)."""

from __future__ import annotations

import math


def pow2(lo: int, hi: int) -> list[float]:
    return [2.0**k for k in range(lo, hi + 1)]


def parabola_sweep(optima, scales=(2, 4, 8, 16, 32), lrs=None, curvature=0.05, floors=None, seeds=(0, 1, 2),
                   seed_offsets=None, diverge_above=None, optimizer="moga", scaling="inverse_depth",
                   scale_key="depth", **extra) -> list[dict]:
    """One record per (scale, lr, seed). ``optima[i]`` is the log2 optimum at ``scales[i]``; a point more
    than ``diverge_above`` log2 units above its optimum diverges."""
    lrs = lrs or pow2(-10, 0)
    floors = floors or [0.3] * len(scales)
    rows = []
    for scale, opt, floor in zip(scales, optima, floors):
        for lr in lrs:
            for seed in seeds:
                x = math.log2(lr)
                loss = floor + curvature * (x - opt) ** 2 + (seed_offsets or {}).get(seed, 0.0)
                diverged = diverge_above is not None and x - opt > diverge_above
                rows.append({
                    "optimizer": optimizer, "scaling": scaling, "scale_key": scale_key, "scale": scale, "lr": lr,
                    "seed": seed, "status": "diverged" if diverged else "finished",
                    "train_loss": math.inf if diverged else loss, "val_loss": math.inf if diverged else loss + 0.1,
                    **extra,
                })
    return rows
