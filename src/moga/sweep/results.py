"""A sweep's cells as records for the report, and as a grid table for `moga sweep status`."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Hashable

from rich.table import Table
from rich.text import Text

from moga.status import DONE, Status
from moga.sweep.spec import Sweep, cell_id
from moga.sweep.store import SweepStore
from moga.train.config import apply_overrides, build_config

METRICS = ("final_train_loss", "train_eval_loss", "val_loss", "val_acc", "train_eval_acc", "steps", "wall_time_s")


def records(store: SweepStore) -> list[dict]:
    """One flat dict per settled cell of the current grid: its axis values, status and final metrics (inf when
    diverged). Finished cells an extension left out of the grid stay in the store, not in the records.
    The optimizer (``optim.name``) is always there: from the base config when it is not an axis."""
    base = store.definition()["base"]
    out = []
    grid = store.grid()
    for cell in store.cells():
        if cell["status"] not in DONE or (grid is not None and cell["id"] not in grid):
            continue
        result = cell["result"] or {}
        rec = {**cell["params"], "cell": cell["id"], "status": cell["status"]}
        rec.setdefault("seed", base.get("seed", 0))  # a grid cell runs the base config's seed
        if "optim.name" not in rec:
            items = [f"{k}={json.dumps(v)}" for k, v in cell["params"].items()]
            rec["optim.name"] = build_config(apply_overrides(json.loads(json.dumps(base)), items)).optim.name
        for key in METRICS:
            if key in result:
                rec[key] = result[key]
        # The papers' training loss is the final-epoch training loss (moga.train.engine).
        rec["train_loss"] = result.get("final_train_loss", math.inf)
        if cell["status"] != Status.FINISHED:
            rec["train_loss"] = math.inf
            rec["val_loss"] = math.inf
        out.append(rec)
    return out


def format_lr(lr: float | None) -> str:
    """2^-4 on a power-of-two grid, 3 significant digits otherwise (0 and negative rates too); n/a for none."""
    if lr is None or not math.isfinite(lr):
        return "n/a"
    k = round(math.log2(lr)) if lr > 0 else None
    return f"2^{k}" if k is not None and abs(math.log2(lr) - k) < 1e-9 else f"{lr:.3g}"


def status_table(store: SweepStore, lr_key: str, metric: str = "final_train_loss"):
    """A rich Table: one row per combination of the other axes, one column per learning rate."""
    cells = store.cells()
    try:
        lrs = sorted({c["params"][lr_key] for c in cells})
        row_keys = [k for k in cells[0]["params"] if k != lr_key] if cells else []
        rows: dict[tuple, dict] = {}
        for c in cells:  # list and mapping values (optim.betas, optim.overrides) as their JSON text
            key = tuple(v if isinstance(v := c["params"][k], Hashable) else json.dumps(v, sort_keys=True)
                        for k in row_keys)
            rows.setdefault(key, {})[c["params"][lr_key]] = c
        if not all(isinstance(lr, (int, float)) and not isinstance(lr, bool) for lr in lrs):
            raise TypeError("a learning rate is not a number")
    except (KeyError, TypeError, ValueError) as e:  # rows that are no grid: no lr, or unlike the others
        raise store.damaged(f"its cells do not form a grid over {lr_key} ({type(e).__name__}: {e})") from None
    counts = store.counts()
    table = Table(title=f"{metric} by {lr_key}  ({', '.join(f'{k} {v}' for k, v in counts.items() if v)})")
    for k in row_keys:
        table.add_column(k.rsplit(".", 1)[-1], no_wrap=True)
    for lr in lrs:
        table.add_column(format_lr(lr), justify="right", no_wrap=True)
    for key, by_lr in rows.items():
        table.add_row(*(Text(str(k)) for k in key), *(_mark(by_lr.get(lr), metric) for lr in lrs))  # never markup
    return table


def plan_table(sweep: Sweep, store: SweepStore) -> tuple[Table, str]:
    """What running ``sweep`` into ``store`` would do, writing nothing: a rich Table of its cells in the config's
    order, each with its state in the store ("new" where the store lacks it), and a summary line.
    A store that holds another sweep is refused as a run would refuse it."""
    have = {}
    if store.exists():
        store.refuse_another(store.definition(), sweep)
        have = {c["id"]: c["status"] for c in store.cells()}
    ids = [cell_id(c) for c in sweep.cells]
    table = Table(title=f"{len(ids)} cells -> {store.dir}")
    table.add_column("#", justify="right")
    for key in sweep.spec.axes:
        table.add_column(key.rsplit(".", 1)[-1], no_wrap=True)
    extra = sorted({k for c in sweep.cells for k in c if k not in sweep.spec.axes})  # include's keys (seed)
    for key in extra:
        table.add_column(key.rsplit(".", 1)[-1], no_wrap=True)
    table.add_column("state", no_wrap=True)
    each = [have.get(cid, "new") for cid in ids]
    for i, (cell, state) in enumerate(zip(sweep.cells, each)):
        values = [cell.get(k, "") for k in (*sweep.spec.axes, *extra)]
        table.add_row(str(i), *(Text(v if isinstance(v, str) else json.dumps(v)) for v in values), state)
    states = Counter(each)
    settled, failed = sum(states[s] for s in DONE), states[Status.FAILED]
    waiting = len(ids) - settled - failed - states["new"]
    summary = (f"{len(ids) - settled - failed} of {len(ids)} cells would run ({states['new']} new, {waiting} waiting "
               f"or resumed); {settled} settled" + (f"; {failed} failed (run again with --retry-failed)" if failed
                                                     else "") + "; nothing was written")
    return table, summary


def _mark(cell: dict | None, metric: str) -> str:
    if cell is None:
        return ""
    status = cell["status"]
    if status == Status.FINISHED:
        value = (cell["result"] or {}).get(metric)
        return f"{value:.4g}" if isinstance(value, (int, float)) else "done"
    return {Status.DIVERGED: "div", Status.SKIPPED: "skip", Status.RUNNING: "run", Status.PENDING: "·", Status.FAILED: "FAIL"}[status]
