"""What the ``moga smoothness`` experiments share: a log-log slope, the verdict it gives, and the output files.

A claim about scaling ("flat in depth", "grows like sqrt(width)") is judged by the least-squares slope of
``log(value)`` against ``log(depth or width)``: flat is ``|slope| <= FLAT_TOLERANCE``, growing is
``slope > FLAT_TOLERANCE``, ``sqrt`` growth is ``|slope - 0.5| <= FLAT_TOLERANCE``. With 0.15 a flat curve
changes by less than a factor ``32^0.15 = 1.7`` over the 32-fold range the experiments span (2..64, 32..1024):
wide enough for the noise of a lower-bound estimate, narrow enough that ``sqrt`` (slope 0.5) is not flat.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from moga.files import write_json, write_text

FLAT_TOLERANCE = 0.15


def loglog_slope(xs, ys) -> float | None:
    """Least-squares slope of ``log y`` on ``log x`` over the points with a finite, positive ``y``."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y is not None and math.isfinite(y) and y > 0]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None
    a = np.array(pts)
    return float(np.polyfit(a[:, 0], a[:, 1], 1)[0])


def trend(slope: float | None, tol: float = FLAT_TOLERANCE) -> str:
    if slope is None:
        return "unmeasured"
    return "flat" if abs(slope) <= tol else ("growing" if slope > 0 else "shrinking")


def held(value: bool | None) -> str:
    return "not measured" if value is None else ("held" if value else "not held")


def spearman(xs, ys) -> float | None:
    """Rank correlation of two sequences (no ties expected); None with fewer than 3 finite points."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    if len(pts) < 3:
        return None
    rx = np.argsort(np.argsort([p[0] for p in pts]))
    ry = np.argsort(np.argsort([p[1] for p in pts]))
    return float(np.corrcoef(rx, ry)[0, 1])


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return lines


def write_results(out: Path, result: dict, summary: list[str]) -> dict:
    """``results.json`` (every number; NaN and inf as JSON's NaN/Infinity) and ``summary.md``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    write_text(out / "summary.md", "\n".join(summary) + "\n")
    result["files"] = {"results": str(out / "results.json"), "summary": str(out / "summary.md"),
                       **result.get("files", {})}
    return result
