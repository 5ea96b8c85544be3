"""Real sweep stores of synthetic losses, for the judges' tests (no training)."""

from __future__ import annotations

import json
import math

from moga.status import Status
from moga.sweep.spec import Sweep
from moga.sweep.store import SweepStore

WIDTHS = [64, 128, 256]
LRS = {"moga": [2.0**k for k in range(-6, -1)], "adamw": [2.0**k for k in range(-11, -6)],
       "muon": [2.0**k for k in range(-8, -3)]}
SEEDS = [0, 1, 2]


def sweep_dict(**axes) -> dict:
    return {"name": "q", "scale_key": "model.n_embd",
            "base": {"model": {"name": "gpt", "n_layer": 1, "n_head": 2}, "data": {"name": "text", "block_size": 8},
                     "optim": {"name": "moga"}, "train": {"steps": 3, "batch_size": 2}},
            "axes": {"optim.name": list(LRS), "model.n_embd": WIDTHS, "seed": SEEDS,
                     "optim.lr": {"by": "optim.name", "values": {n: v for n, v in LRS.items()}}, **axes}}


def store_losses(out, sweep: Sweep, loss) -> None:
    """Every cell of ``sweep`` finished in a real store with ``loss(params)`` (inf: diverged)."""
    store = SweepStore(out)
    store.create_or_check(sweep)
    rows = []
    for cell in store.cells():
        value = loss(cell["params"])
        status = Status.FINISHED if math.isfinite(value) else Status.DIVERGED
        rows.append((str(status), json.dumps({"final_train_loss": value}), cell["id"]))
    with store._write() as con:  # one transaction: claiming and finishing cell by cell takes seconds
        con.executemany("UPDATE cells SET status = ?, result = ? WHERE id = ?", rows)


def parabola(optimum: float, floor: float, curvature: float = 0.01):
    return lambda lr: floor * (1 + curvature * (math.log2(lr) - optimum) ** 2)
