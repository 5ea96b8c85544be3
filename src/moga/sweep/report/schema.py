"""The report's input: one record per cell of a sweep (one training run).

A record names its panel (``optimizer``, ``scaling``, or any other key given as ``group_keys``), its
curve (``scale``: the depth or width, named by ``scale_key``), its point on the curve (``lr``), its
``seed``, its ``status`` and its final metrics. Keys other than the named fields are kept (``extra``)
and can be used for grouping.

How a status counts:

- ``finished``: the metrics are used as recorded; a non-finite loss counts as diverged;
- ``diverged``: the loss is ``inf`` whatever was recorded;
- ``skipped``: the runner skips a cell once a smaller lr of the same row diverged
  (``early_stop_diverged``), so it is counted as diverged, which is what the runner inferred;
- anything else (``pending``, ``running``, ``failed``): missing. Listed in ``cells.csv``, not drawn,
  and never mistaken for a divergence.

The sweep runner's records (``moga.sweep.results.records``) use the config's dotted keys; those are
accepted as aliases (``optim.name`` -> ``optimizer``, ``model.depth_scaling`` -> ``scaling``,
``optim.lr`` -> ``lr``), and ``scale`` is read from the ``scale_key`` column when absent.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moga.status import DIVERGED_LIKE, Status

METRICS = ("train_loss", "val_loss")
ALIASES = {"optim.name": "optimizer", "model.depth_scaling": "scaling", "optim.lr": "lr"}
# Tried in order when neither ``scale`` nor a ``scale_key`` says where the scale is.
SCALE_KEYS = ("depth", "model.depth", "width", "model.width", "model.n_layer", "model.n_embd")
SCALING_LABELS = {"none": "alpha=1", "inverse_depth": "alpha=K_base/K"}


class SweepRecord(BaseModel):
    """One cell of a sweep. Unknown keys are kept as extras (``record.get(key)`` reads either)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    optimizer: str = Field(description="optimizer name; one panel per (optimizer, scaling) by default")
    scaling: str = Field("", description="residual scaling mode, e.g. 'none' (alpha=1) or 'inverse_depth'")
    scale_key: str = Field("depth", description="what `scale` counts: depth, width, or a config key")
    scale: int | float = Field(gt=0, description="the model's depth or width; one curve per value")
    lr: float = Field(gt=0, description="learning rate; the x axis, on a log2 scale")
    seed: int = Field(0, description="seed of the run; seeds of one (scale, lr) are aggregated")
    status: str = Field(Status.FINISHED.value, description="finished, diverged, skipped (counted as diverged), or missing")
    train_loss: float | None = Field(None, description="final training loss")
    val_loss: float | None = Field(None, description="final validation loss")
    val_acc: float | None = Field(None, description="final validation accuracy (listed, not analysed)")

    def get(self, key: str) -> Any:
        if key in type(self).model_fields:
            return getattr(self, key)
        return (self.model_extra or {}).get(key)

    @property
    def diverged(self) -> bool:
        return self.status in DIVERGED_LIKE

    @property
    def missing(self) -> bool:
        return self.status != Status.FINISHED and not self.diverged

    def loss(self, metric: str) -> float | None:
        """``inf`` when diverged, None when missing, else the recorded value."""
        if self.diverged:
            return math.inf
        if self.missing:
            return None
        value = self.get(metric)
        if value is None:
            return None
        value = float(value)
        return value if math.isfinite(value) else math.inf


def parse_records(rows: Iterable[Mapping | SweepRecord], scale_key: str | None = None) -> list[SweepRecord]:
    """Validate plain dicts into records. ``scale_key`` says which column holds the scale when a row
    has no ``scale`` (the runner's rows have ``model.depth``, say); it is also stored on the record."""
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, SweepRecord):
            out.append(row)
            continue
        data = dict(row)
        for alias, name in ALIASES.items():
            if alias in data and name not in data:
                data[name] = data[alias]
        if "scale" not in data:
            key = scale_key or data.get("scale_key") or next((k for k in SCALE_KEYS if k in data), None)
            if key is None or key not in data:
                raise ValueError(f"record {i} has no 'scale' and no scale column (give scale_key): {row!r}")
            data["scale"], data["scale_key"] = data[key], key
        elif scale_key and "scale_key" not in data:
            data["scale_key"] = scale_key
        try:
            out.append(SweepRecord.model_validate(data))
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ValueError(f"record {i} is not a sweep record ({problems}): {row!r}") from None
    return out


def load_records(path: str | Path, scale_key: str | None = None) -> list[SweepRecord]:
    """Records from ``.jsonl`` (one per line), ``.json`` (a list, or ``{"records": [...]}``) or ``.csv``
    (e.g. a previous report's ``cells.csv``). A directory is searched for records.jsonl, records.json,
    cells.csv in that order."""
    path = Path(path)
    if path.is_dir():
        found = [path / n for n in ("records.jsonl", "records.json", "cells.csv") if (path / n).is_file()]
        if not found:
            raise FileNotFoundError(f"{path} has no records.jsonl, records.json or cells.csv")
        path = found[0]
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif path.suffix == ".json":
        data = json.loads(text)
        rows = data["records"] if isinstance(data, dict) else data
    elif path.suffix == ".csv":
        # empty fields are absent values, not empty strings (which no float accepts)
        rows = [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(text.splitlines())]
    else:
        raise ValueError(f"{path}: expected .jsonl, .json or .csv")
    return parse_records(rows, scale_key)


def scale_label(scale_key: str, scale: float) -> str:
    """'K=8' for depths (the papers' notation), 'width 256' for widths, 'key=value' otherwise."""
    name = scale_key.rsplit(".", 1)[-1]
    value = f"{scale:g}"
    if name in ("depth", "n_layer", "K"):
        return f"K={value}"
    if name == "width":
        return f"width {value}"
    return f"{name}={value}"


def scaling_label(scaling: str) -> str:
    label = SCALING_LABELS.get(scaling)
    return f"{scaling} ({label})" if label else scaling
