"""Figures of the ``moga smoothness`` experiments and of a run's per-layer diagnostics (matplotlib, Agg)."""

from __future__ import annotations

import math
from pathlib import Path

from moga.files import save_figure

# Deferred on purpose, imported where used: matplotlib (about 0.5 s to import), only when a figure is drawn.


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite_points(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y) and y > 0]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_scaling(rows: list[dict], xkey: str, path: Path, xlabel: str, series: str) -> Path:
    """Lipschitz and smoothness (matrix block) against ``xkey`` on log-log axes: one row of panels per model,
    one colour per ``series`` value, solid at initialization and dashed after training."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("block", "matrix") == "matrix"]
    models = list(dict.fromkeys(r.get("model", "") for r in rows))
    names = list(dict.fromkeys(r[series] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, quantity in enumerate(("lipschitz", "smoothness")):
            ax = axes[i][j]
            for c, name in enumerate(names):
                for phase, style in (("init", "-"), ("trained", "--")):
                    pts = sorted((r[xkey], r[quantity]) for r in rows if r.get("model", "") == model
                                 and r[series] == name and r["phase"] == phase)
                    xs, ys = _finite_points([p[0] for p in pts], [p[1] for p in pts])
                    if xs:
                        ax.plot(xs, ys, style, marker="o", ms=3, color=f"C{c}", label=f"{name}, {phase}")
            if xkey == "width" and quantity == "smoothness":  # the width paper's worst case for spectral
                ref = sorted((r[xkey], r[quantity]) for r in rows if r[series] == "spectral" and r["phase"] == "init")
                xs, ys = _finite_points([p[0] for p in ref], [p[1] for p in ref])
                if xs:
                    ax.plot(xs, [ys[0] * math.sqrt(x / xs[0]) for x in xs], ":", color="0.5", label="~ sqrt(width)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{quantity} (block norm)")
            ax.set_title(f"{model + ': ' if model else ''}{quantity}" + (" (lower bound)" if quantity == "smoothness"
                                                                         else ""))
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, handlelength=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def plot_curves(panels: list[dict], path: Path, ncols: int = 2) -> Path:
    """Training curves: each panel ``{"title", "ylabel", "logy", "curves": [{"label", "x", "y"}]}``."""
    plt = _pyplot()
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        for c, curve in enumerate(panel["curves"]):
            xs, ys = [], []
            for x, y in zip(curve["x"], curve["y"]):
                if y is not None and math.isfinite(y) and (y > 0 or not panel.get("logy")):
                    xs.append(x)
                    ys.append(y)
            ax.plot(xs, ys, curve.get("style", "-"), color=curve.get("color", f"C{c}"), lw=1.3, label=curve["label"])
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.set_xlabel(panel.get("xlabel", "step"))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.set_title(panel["title"], fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if panel.get("legend", True):
            ax.legend(fontsize=6 if len(panel["curves"]) > 8 else 7, ncol=2 if len(panel["curves"]) > 12 else 1,
                      handlelength=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


DIAGNOSTIC_PANELS = (
    ("update_over_lr", "update norm / lr", False, "1 for an LMO step"),
    ("grad_dual_norm", "gradient dual norm ||G_k||_k*", True, ""),
    ("weight_norm", "||W_k||_k", True, ""),
    ("trajectory_smoothness", "trajectory smoothness", True, "||dG_k||_k* / ||dW_k||_k"),
)


def plot_diagnostics(records: list[dict], path: Path) -> Path:
    """A run's ``"diagnostics"`` records, per layer over training: update / lr, gradient dual norm, ||W|| in the
    layer's geometry and trajectory smoothness (all on the run's probe batch)."""
    if not records:
        raise ValueError("no diagnostics records: train with logging.diagnostics_every=N (N > 0)")
    names = list(dict.fromkeys(layer["name"] for r in records for layer in r["layers"]))
    steps = [r["step"] for r in records]
    panels = []
    for key, label, logy, note in DIAGNOSTIC_PANELS:
        curves = []
        for c, name in enumerate(names):
            ys = []
            for r in records:
                row = next((layer for layer in r["layers"] if layer["name"] == name), {})
                value = row.get(key)
                ys.append(math.nan if value is None else float(value))
            style = "--" if any(layer["name"] == name and layer.get("update") == "adam"
                                for layer in records[0]["layers"]) else "-"
            curves.append({"label": name, "x": steps, "y": ys, "style": style, "color": f"C{c % 10}"})
        panels.append({"title": label + (f" ({note})" if note else ""), "ylabel": label, "logy": logy,
                       "curves": curves})
    for panel in panels[1:]:  # one legend is enough: every panel has the same layers in the same colours
        panel["legend"] = False
    return plot_curves(panels, path)
