"""Markdown and self-contained HTML from the report's blocks, and the terminal table of verdicts.

The HTML is built with the standard library (``html.escape``), so the report needs no template
engine; figures are embedded as base64 PNG, so the file can be mailed or archived on its own.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from moga.sweep.report.document import Block, Figure, Heading, Items, Paragraph, Table
from moga.sweep.report.summary import PanelSummary
from moga.verdicts import DOES_NOT_TRANSFER, INCONCLUSIVE, NO_VERDICT, TRANSFERS

CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child, td:last-child { text-align: left; }
img { max-width: 100%; }
li { margin: 0.2em 0; }
"""


def to_markdown(blocks: Sequence[Block], base_dir: Path) -> str:
    """Figures are linked relative to ``base_dir`` (where report.md is written)."""
    out = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + b.text)
        elif isinstance(b, Paragraph):
            out.append(b.text)
        elif isinstance(b, Items):
            out.append("\n".join(f"- **{label}**: {text}" if label else f"- {text}" for label, text in b.items))
        elif isinstance(b, Table):
            cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
            lines = ["| " + " | ".join(map(cell, b.header)) + " |", "|" + "---|" * len(b.header)]
            lines += ["| " + " | ".join(map(cell, row)) + " |" for row in b.rows]
            out.append("\n".join(lines))
        elif isinstance(b, Figure):
            out.append(f"![{b.alt}]({Path(os.path.relpath(b.path, base_dir)).as_posix()})")
    return "\n\n".join(out) + "\n"


def to_html(blocks: Sequence[Block], title: str) -> str:
    e = html.escape
    out = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{e(b.text)}</h{b.level}>")
        elif isinstance(b, Paragraph):
            out.append(f"<p>{e(b.text)}</p>")
        elif isinstance(b, Items):
            lis = "".join(f"<li><strong>{e(label)}</strong>: {e(text)}</li>" if label else f"<li>{e(text)}</li>"
                          for label, text in b.items)
            out.append(f"<ul>{lis}</ul>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{e(h)}</th>" for h in b.header)
            rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in b.rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif isinstance(b, Figure):
            data = base64.b64encode(Path(b.path).read_bytes()).decode("ascii")
            out.append(f'<p><img alt="{e(b.alt)}" src="data:image/png;base64,{data}"></p>')
    body = "\n".join(out)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


VERDICT_STYLES = {TRANSFERS: "green", DOES_NOT_TRANSFER: "red", INCONCLUSIVE: "yellow", NO_VERDICT: "yellow"}


def verdict_table(summaries: Mapping[str, Sequence[PanelSummary]]):
    """A rich Table: one row per panel and metric, with the verdict and its numbers."""
    table = RichTable(title="learning-rate transfer")
    for col in ("panel", "loss", "verdict", "steps", "log2", "slope", "regret"):
        table.add_column(col, justify="left" if col in ("panel", "loss", "verdict") else "right")
    table.caption = ("steps: drift of the grid optima in grid steps; log2: drift of the refined optima; "
                     "slope: log2 units per doubling of scale; regret: worst cost of reusing the smallest "
                     "scale's lr")
    for metric, panels in summaries.items():
        for p in panels:
            d, w = p.drift, p.worst_regret
            off_grid = any(not c.trusted for c in p.curves) and d.steps_at_least is not None
            steps = f">= {d.steps_at_least:g}" if off_grid else f"{d.steps}" if d.steps is not None else "n/a"
            regret = "n/a" if w is None else "diverges" if w.status == "diverges" else (
                f"{100 * w.relative:.1f}%" if w.relative is not None else f"{w.absolute:.3g}")
            table.add_row(
                escape(p.title), metric.removesuffix("_loss"), f"[{VERDICT_STYLES[p.verdict]}]{p.verdict}[/]", steps,
                f"{d.log2_refined:.2f}" if d.log2_refined is not None else "n/a",
                f"{d.slope_per_doubling:+.2f}" if d.slope_per_doubling is not None else "n/a", regret)
    return table


def print_verdicts(summaries: Mapping[str, Sequence[PanelSummary]], console=None) -> None:
    console = console or Console()
    console.print(verdict_table(summaries))
    for metric, panels in summaries.items():
        for p in panels:
            console.print(f"{p.title} ({metric}): {p.verdict_line}", markup=False, highlight=False)
