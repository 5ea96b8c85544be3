"""``write_report``: every output of ``moga report`` in one directory.

- ``report.md`` and ``report.html`` (self-contained: figures embedded as base64 PNG);
- ``summary.json``: per metric and panel the optima, drifts, regrets, intervals and verdicts
  (strict JSON: non-finite numbers are null; a null loss on a curve is a diverged point);
- ``cells.csv``: every run, one row each, with how the report counted it;
- ``figures/<metric>.png`` (and ``.pdf`` or ``.svg``) for the training and the validation loss.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from moga.files import refuse_symlinks, replacing, write_text
from moga.sweep.report.document import DEFINITIONS, build_document
from moga.sweep.report.figures import plot_panels
from moga.sweep.report.metrics import GROUP_KEYS, analyze, select_scale
from moga.sweep.report.summary import PanelSummary
from moga.sweep.report.render import to_html, to_markdown
from moga.sweep.report.schema import METRICS, SweepRecord, parse_records
from moga.status import Status


def write_report(records: Iterable[SweepRecord | Mapping], out_dir: str | Path, scale_key: str | None = None,
                 title: str | None = None, metrics: Sequence[str] = METRICS,
                 group_keys: Sequence[str] = GROUP_KEYS, formats: Sequence[str] = ("png", "pdf"),
                 **analyze_options) -> dict[str, Path]:
    """Analyze ``records`` and write the report; returns {relative name: path} of every file written.

    A metric no finished record has (e.g. no validation loss) is left out. ``analyze_options`` go to
    :func:`moga.sweep.report.analyze` (max_drift_steps, max_drift_log2, resamples, level, seed).
    """
    records = select_scale(parse_records(records, scale_key), scale_key)
    summaries = analyze_metrics(records, metrics, group_keys, **analyze_options)
    return write_outputs(summaries, records, out_dir, title, group_keys, formats)


def analyze_metrics(records: Sequence[SweepRecord], metrics: Sequence[str] = METRICS,
                    group_keys: Sequence[str] = GROUP_KEYS, **analyze_options) -> dict[str, list[PanelSummary]]:
    """{metric: panels} for each metric that some finished record has; records of one scale_key."""
    if not records:
        raise ValueError("no records to report on")
    scale_key = records[0].scale_key
    return {
        m: analyze(records, scale_key, m, group_keys, **analyze_options)
        for m in metrics if any(r.status == Status.FINISHED and r.get(m) is not None for r in records)
    }


def write_outputs(summaries: Mapping[str, Sequence[PanelSummary]], records: Sequence[SweepRecord],
                  out_dir: str | Path, title: str | None = None, group_keys: Sequence[str] = GROUP_KEYS,
                  formats: Sequence[str] = ("png", "pdf")) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    refuse_symlinks(out_dir / "figures")  # the files themselves are replaced, never written through (moga.files)
    scale_key = records[0].scale_key
    title = title or f"Learning-rate transfer across {scale_key.rsplit('.', 1)[-1]}"
    formats = ["png", *(f for f in formats if f != "png")]  # the HTML embeds the PNG
    written: dict[str, Path] = {}
    pngs = {}
    for metric, panels in summaries.items():
        for path in plot_panels(panels, out_dir / "figures" / metric, formats):
            written[path.relative_to(out_dir).as_posix()] = path
        pngs[metric] = out_dir / "figures" / f"{metric}.png"

    blocks = build_document(summaries, pngs, records, title)
    files = {
        "report.md": to_markdown(blocks, out_dir),
        "report.html": to_html(blocks, title),
        "summary.json": json.dumps(summary_dict(summaries, title, scale_key, group_keys, records), indent=2,
                                   allow_nan=False) + "\n",
    }
    for name, text in files.items():
        write_text(out_dir / name, text)
        written[name] = out_dir / name
    written["cells.csv"] = write_cells_csv(records, out_dir / "cells.csv", group_keys)
    return written


def summary_dict(summaries: Mapping[str, Sequence[PanelSummary]], title: str, scale_key: str,
                 group_keys: Sequence[str], records: Sequence[SweepRecord]) -> dict:
    return {
        "title": title,
        "scale_key": scale_key,
        "group_keys": list(group_keys),
        "runs": {"total": len(records), "diverged": sum(r.diverged for r in records),
                 "missing": sum(r.missing for r in records)},
        "verdicts": [{"metric": m, "panel": p.panel, "verdict": p.verdict, "line": p.verdict_line}
                     for m, panels in summaries.items() for p in panels],
        "metrics": {m: [p.to_dict() for p in panels] for m, panels in summaries.items()},
        "definitions": dict(DEFINITIONS),
    }


def write_cells_csv(records: Sequence[SweepRecord], path: Path, group_keys: Sequence[str] = GROUP_KEYS) -> Path:
    """One row per run, sorted by panel, scale, lr and seed; ``counted_as`` says how the report used it."""
    fixed = [*dict.fromkeys([*group_keys, "optimizer", "scaling"]), "scale_key", "scale", "lr", "log2_lr", "seed",
             "status", "counted_as", "train_loss", "val_loss", "val_acc"]
    extras = sorted({k for r in records for k in (r.model_extra or {})} - set(fixed))
    rows = sorted(records, key=lambda r: (*(str(r.get(k)) for k in group_keys), r.scale, r.lr, r.seed))
    with replacing(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fixed + extras)
        for r in rows:
            counted = "diverged" if r.diverged else "missing" if r.missing else "finished"
            values = {"log2_lr": math.log2(r.lr), "counted_as": counted}
            writer.writerow([_cell(values[k] if k in values else r.get(k)) for k in fixed + extras])
    return path


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf" if value < 0 else "nan")
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
