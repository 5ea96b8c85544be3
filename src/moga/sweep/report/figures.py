"""The papers' figure: final loss against lr (log2 axis), one curve per scale, a star on each minimum.

One panel per summary (optimizer x scaling mode: rows are the first group key, columns the second).
Each curve is the seed mean with a band from the best to the worst finite seed. Diverged points are
marked, not dropped: an ``x`` in the curve's colour in a strip along the top of the panel. The star
is the grid optimum; it is hollow when the optimum is at the grid edge (not trustworthy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from moga.files import save_figure
from moga.sweep.report.summary import PanelSummary
from moga.sweep.report.schema import scale_label

METRIC_LABELS = {"train_loss": "final training loss", "val_loss": "final validation loss"}
DATA_TOP = 0.85  # share of the panel height for the data; the strip above holds the diverged marks


def plot_panels(summaries: Sequence[PanelSummary], path_stem: str | Path,
                formats: Sequence[str] = ("png", "pdf"), dpi: int = 150) -> list[Path]:
    """Draw all panels of one metric into one figure; write ``path_stem.<format>`` for each format."""
    if not summaries:
        return []
    layout = _layout(summaries)
    nrows, ncols = max(r for r, _ in layout) + 1, max(c for _, c in layout) + 1
    plt = pyplot()
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for summary, (row, col) in zip(summaries, layout):
        axes[row][col].set_visible(True)
        draw_panel(axes[row][col], summary)
    metric = summaries[0].metric
    fig.suptitle(METRIC_LABELS.get(metric, metric) + " vs learning rate")
    fig.tight_layout()
    path_stem = Path(path_stem)
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = path_stem.with_name(f"{path_stem.name}.{fmt}")
        save_figure(fig, path, dpi=dpi)
        paths.append(path)
    plt.close(fig)
    return paths


def _layout(summaries: Sequence[PanelSummary]) -> list[tuple[int, int]]:
    """Two group keys: a rows x columns table of their values (first appearance order); else wrap by 3."""
    keys = list(summaries[0].panel)
    if len(keys) == 2:
        rows = list(dict.fromkeys(s.panel[keys[0]] for s in summaries))
        cols = list(dict.fromkeys(s.panel[keys[1]] for s in summaries))
        return [(rows.index(s.panel[keys[0]]), cols.index(s.panel[keys[1]])) for s in summaries]
    ncols = min(3, len(summaries))
    return [divmod(i, ncols) for i in range(len(summaries))]


def pyplot():
    """matplotlib's pyplot on the file-only backend, imported when a figure is drawn (it costs a command that
    draws none, such as ``moga reproduce --list``, a third of a second)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def draw_panel(ax, s: PanelSummary) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.transforms import blended_transform_factory

    cmap = pyplot().get_cmap("viridis")
    n = len(s.curves)
    top_strip = blended_transform_factory(ax.transData, ax.transAxes)
    finite = [v for c in s.curves for v in (*c.loss, *(x for x in c.loss_max if x is not None)) if math.isfinite(v)]
    any_diverged = False
    for j, c in enumerate(s.curves):
        color = cmap(0.9 * j / max(n - 1, 1))
        y = [v if math.isfinite(v) else math.nan for v in c.loss]  # nan breaks the line at a divergence
        ax.plot(c.lrs, y, "-o", color=color, ms=3, lw=1.5, label=scale_label(s.scale_key, c.scale))
        if max(c.n_seeds) > 1:
            lo = [math.nan if v is None or not math.isfinite(m) else v for v, m in zip(c.loss_min, c.loss)]
            hi = [math.nan if v is None or not math.isfinite(m) else v for v, m in zip(c.loss_max, c.loss)]
            ax.fill_between(c.lrs, lo, hi, color=color, alpha=0.15, lw=0)
        div = [lr for lr, v in zip(c.lrs, c.loss) if math.isinf(v)]
        if div:
            any_diverged = True
            row = 1 - (1 - DATA_TOP) * (j + 1) / (n + 1)  # one row of marks per curve inside the strip
            ax.plot(div, [row] * len(div), "x", color=color, ms=5, mew=1.5, transform=top_strip, clip_on=False)
        if c.best_lr is not None:
            ax.plot([c.best_lr], [c.best_loss], marker="*", ms=15, mec="black", mew=0.8, zorder=5,
                    mfc=color if c.trusted else "none", ls="none")
    ax.set_xscale("log", base=2)
    if finite:
        lo, hi = min(finite), max(finite)
        pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.05
        ax.set_ylim(lo - pad, lo - pad + (hi + pad - (lo - pad)) / DATA_TOP)
    ax.set_xlabel("learning rate")
    ax.set_ylabel(s.metric.replace("_", " "))
    ax.set_title(f"{s.title}\n{s.verdict}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], marker="*", color="grey", mec="black", ls="none", ms=10, label="optimum"))
    if any_diverged:
        handles.append(Line2D([], [], marker="x", color="grey", ls="none", label="diverged"))
    ax.legend(handles=handles, fontsize=7, loc="best", framealpha=0.8)
