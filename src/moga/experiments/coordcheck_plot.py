"""The coordinate check's figure: a row per quantity, a column per step (step 0 is the init), each layer
one colour in every panel, one legend. Both axes are base-2 logs: the x ticks are the widths themselves,
and a quantity that is constant (an update's norm, lr by construction) still gets a tick in its range."""

from __future__ import annotations

ROWS = {
    "output": "RMS of output",
    "update": "RMS of the step's effect",
    "gain": "effect / input RMS",
    "norm": "step norm (geometry)",
}


def figure(records, optimizer: str, depth: int | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    rs = [r for r in records if r.optimizer == optimizer and r.depth == depth]
    steps = sorted({r.step for r in rs})
    layers = list(dict.fromkeys(r.layer for r in rs))
    widths = sorted({r.width for r in rs})
    palette = plt.get_cmap("tab20" if len(layers) > 10 else "tab10")
    colour = {layer: palette(k % palette.N) for k, layer in enumerate(layers)}
    fig, axes = plt.subplots(len(ROWS), len(steps), figsize=(2.6 * len(steps) + 2.4, 2.2 * len(ROWS)),
                             squeeze=False, sharex=True, sharey="row", layout="constrained")
    for row, (q, title) in enumerate(ROWS.items()):
        values = []
        for col, s in enumerate(steps):
            ax = axes[row][col]
            if s == 0 and q != "output":  # nothing has stepped yet; the next panel carries the y labels
                ax.set_axis_off()
                axes[row][col + 1].tick_params(labelleft=True)
                continue
            for layer in layers:
                at = sorted((r.width, getattr(r, q)) for r in rs if r.step == s and r.layer == layer)
                ys = [v for _, v in at]
                values += [v for v in ys if v > 0]
                ax.plot([w for w, _ in at], ys, marker="o", ms=3, color=colour[layer], label=layer)
            ax.set_title(f"{title}, {'init' if s == 0 else f'step {s}'}", fontsize=8)
            ax.grid(True, which="major", alpha=0.3)
        ax0 = axes[row][1 if len(steps) > 1 and steps[0] == 0 and q != "output" else 0]
        ax0.set_yscale("log", base=2)
        if values:  # at least a factor 4 of range, so a power of 2 always lies inside
            lo, hi = min(values), max(values)
            pad = max(2.0, (4 * lo / hi) ** 0.5)
            ax0.set_ylim(lo / pad, hi * pad)
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(widths))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(widths, [str(w) for w in widths], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("width", fontsize=8)
    if steps[0] == 0 and len(ROWS) > 1:  # the init column ends after its first row
        axes[0][0].tick_params(labelbottom=True)
        axes[0][0].set_xlabel("width", fontsize=8)
    handles = [h for h in axes[0][0].get_lines()]
    fig.legend(handles, [h.get_label() for h in handles], loc="outside right center", fontsize=7)
    fig.suptitle(f"coordinate check: {optimizer}" + (f", depth {depth}" if depth is not None else ""))
    return fig
