"""The report's content, once, as a list of blocks; :mod:`render` writes it as Markdown and HTML.

Keeping the content separate from the two formats is what keeps report.md and report.html saying
the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from moga.sweep.report.figures import METRIC_LABELS
from moga.sweep.report.summary import PanelSummary
from moga.sweep.report.schema import SweepRecord, scale_label
from moga.sweep.results import format_lr


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Paragraph:
    text: str


@dataclass
class Items:
    items: list[tuple[str, str]]  # (bold label, text); an empty label gives a plain item


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    path: Path
    alt: str


Block = Heading | Paragraph | Items | Table | Figure

DEFINITIONS = [
    ("Curve", "one per scale: the mean final loss over seeds at each lr. A point where any seed diverged is "
              "diverged (a rate that diverges for some seeds cannot be reused); missing runs are left out."),
    ("Optimum", "the grid argmin of a curve; ties go to the smaller lr. Refined: the vertex of the parabola in "
                "log2(lr) through the argmin and its two neighbours; none at the grid edge, next to a divergence, "
                "or with fewer than 3 finite points (the refined optimum is then the grid optimum)."),
    ("Grid edge", "an optimum at either end of its curve's lrs may lie beyond the grid: it is not trusted, gets no "
                  "transfer verdict, and the report says which way to extend the grid."),
    ("Drift", "largest minus smallest optimum over the scales with a trusted optimum, in grid steps of the "
              "panel's own lr grid and in log2 units; slope: least-squares slope of the refined log2 optimum "
              "against log2(scale), in log2 units per doubling of depth or width. With edge curves, 'at least' "
              "is the smallest drift consistent with where their optima can be."),
    ("Regret", "at each scale, the loss at the smallest scale's best grid lr minus that scale's best loss; "
               "relative: divided by the best loss. 'diverges' when that lr diverges there."),
    ("Criterion", "with every optimum inside its grid: transfers iff the 95% seed intervals put the refined "
                  "optimum's drift within max_drift_steps grid steps (default one; on a grid that is not log-spaced, "
                  "max_drift_log2 log2 units) and the regret of reusing the smallest scale's refined optimum, read "
                  "off each scale's fitted curve, within max_regret (default 2%) at every other scale; does not "
                  "transfer when either is confidently beyond; inconclusive otherwise (one seed always is), with "
                  "about how many seeds would decide it. With an optimum on the grid edge: does not transfer when "
                  "even the smallest drift consistent with the edges exceeds the limit or the smallest scale's rate "
                  "diverges at a larger scale; otherwise no verdict."),
    ("Seeds", "the verdict's intervals resample each (scale, lr) point's seeds, widened to Student's t for few "
              "seeds (moga.sweep.report.decision); the seed-spread paragraph's intervals are percentile "
              "bootstraps of whole seeds per scale, for the optima, drift and slope."),
]


def build_document(summaries: Mapping[str, Sequence[PanelSummary]], figures: Mapping[str, Path],
                   records: Sequence[SweepRecord], title: str) -> list[Block]:
    blocks: list[Block] = [Heading(1, title), Paragraph(_overview(records, summaries))]
    blocks.append(Heading(2, "Verdicts"))
    for metric, panels in summaries.items():
        blocks.append(Paragraph(METRIC_LABELS.get(metric, metric) + ":"))
        blocks.append(Items([(p.title, p.verdict_line) for p in panels]))
    for metric, panels in summaries.items():
        blocks.append(Heading(2, METRIC_LABELS.get(metric, metric).capitalize()))
        if metric in figures:
            blocks.append(Figure(figures[metric], f"{metric} against learning rate"))
        for p in panels:
            blocks += panel_blocks(p)
    blocks += [Heading(2, "Definitions"), Items(DEFINITIONS)]
    return blocks


def panel_blocks(p: PanelSummary) -> list[Block]:
    blocks: list[Block] = [Heading(3, p.title), Paragraph(p.verdict_line), Table(*_optimum_table(p))]
    blocks.append(Paragraph(drift_text(p)))
    if p.bootstrap is not None:
        blocks.append(Paragraph(bootstrap_text(p)))
    notes = p.notes + [f"criterion: {p.criterion}"]
    blocks.append(Items([("", n) for n in notes]))
    return blocks


def _optimum_table(p: PanelSummary) -> tuple[list[str], list[list[str]]]:
    ref = scale_label(p.scale_key, p.reference_scale) if p.reference_scale is not None else "?"
    header = [p.scale_key, "best lr", "refined lr", "best loss", "seeds' best lr", f"loss at {ref}'s lr", "regret",
              "note"]
    regrets = {r.scale: r for r in p.regrets}
    rows = []
    for c in p.curves:
        r = regrets.get(c.scale)
        interval = p.bootstrap.refined_log2_lr.get(c.scale) if p.bootstrap else None
        refined = format_lr(c.refined_lr) if c.refined_lr is not None else "n/a"
        if interval is not None:
            refined += f" [{2 ** interval[0]:.3g}, {2 ** interval[1]:.3g}]"
        status = ("" if c.refinement == "parabola" else c.refinement) if c.trusted else (
            "diverged at every lr" if c.best_lr is None else f"at the {c.edge} grid edge")
        rows.append([
            scale_label(p.scale_key, c.scale), format_lr(c.best_lr), refined, _num(c.best_loss),
            " ".join(format_lr(lr) if lr is not None else "div" for lr in c.seed_best_lrs.values()),
            _num(r.loss) if r else "n/a", _regret_cell(r), status,
        ])
    return header, rows


def _regret_cell(r) -> str:
    if r is None:
        return "n/a"
    if r.status in ("reference", "diverges", "not run", "no optimum"):
        return r.status
    text = f"+{r.absolute:.3g}" + (f" ({100 * r.relative:.1f}%)" if r.relative is not None else "")
    return (">= " + text) if r.lower_bound else text


def drift_text(p: PanelSummary) -> str:
    d = p.drift
    label = lambda s: scale_label(p.scale_key, s)  # noqa: E731
    if len(d.scales) < 2:
        text = "Drift: fewer than two scales with a trusted optimum."
    else:
        steps = f"{d.steps} grid step{'' if d.steps == 1 else 's'}, " if d.steps is not None else ""
        text = (f"Drift over {', '.join(label(s) for s in d.scales)}: {steps}{d.log2_grid:.2f} log2 units "
                f"(grid optima), {d.log2_refined:.2f} log2 units (refined); slope {d.slope_per_doubling:+.2f} "
                f"log2 units per doubling of {p.scale_key.rsplit('.', 1)[-1]}.")
    if d.log2_at_least is not None and len(d.scales) < len(p.curves):
        bound = f"{d.steps_at_least:g} grid steps, " if d.steps_at_least is not None else ""
        text += f" With the curves at the grid edge: at least {bound}{d.log2_at_least:.2f} log2 units."
    step = f", step {p.grid.step_log2:.2f} log2 units" if p.grid.step_log2 else ""
    text += f" Grid: {len(p.grid.lrs)} lrs from {format_lr(p.grid.lrs[0])} to {format_lr(p.grid.lrs[-1])}{step}"
    return text + ("." if p.grid.regular else ", not log-spaced.")


def bootstrap_text(p: PanelSummary) -> str:
    b = p.bootstrap
    pct = f"{100 * b.level:g}%"
    counts = sorted(set(b.seeds.values()))
    seeds = f"{counts[0]} seeds per scale" if len(counts) == 1 else f"{counts[0]} to {counts[-1]} seeds per scale"
    parts = [f"Seed spread ({seeds}, {b.resamples} bootstrap resamples, {pct} intervals):"]
    if b.drift_steps is not None:
        parts.append(f"drift {_interval_cell(b.drift_steps, '{:g}')} grid steps;")
    if b.drift_log2_refined is not None:
        parts.append(f"refined drift {_interval_cell(b.drift_log2_refined)} log2 units;")
    if b.slope_per_doubling is not None:
        parts.append(f"slope {_interval_cell(b.slope_per_doubling, '{:+.2f}')} per doubling;")
    if b.share_within_criterion is not None:
        parts.append(f"the criterion holds in {100 * b.share_within_criterion:.0f}% of resamples.")
    return " ".join(parts)


def _interval_cell(iv, fmt: str = "{:.2f}") -> str:
    return "n/a" if iv is None else f"[{fmt.format(iv[0])}, {fmt.format(iv[1])}]"


def _num(v: float | None) -> str:
    if v is None:
        return "n/a"
    return "diverged" if math.isinf(v) else f"{v:.4g}"


def _overview(records: Sequence[SweepRecord], summaries: Mapping[str, Sequence[PanelSummary]]) -> str:
    diverged = sum(r.diverged for r in records)
    missing = sum(r.missing for r in records)
    finished = len(records) - diverged - missing
    panels = next(iter(summaries.values()), [])
    scale_key = panels[0].scale_key if panels else "scale"
    return (f"{len(records)} runs: {finished} finished, {diverged} diverged or skipped after a divergence, "
            f"{missing} missing (failed or not run). {len(panels)} panels, one curve per {scale_key}.")
