"""Transfer over two scale axes at once (``scale_keys: [model.width, model.depth]``): one curve per pair.

The reference is the smallest pair (smallest first key, then smallest second key). Per panel:

- each pair's grid optimum (the same curve rules as one axis: seed means, ties to the smaller lr, edge);
- drift: largest minus smallest grid optimum over the pairs with a trusted optimum, in grid steps;
- regret at each pair of reusing the reference's best lr (relative; ``inf`` where it diverges; a lower
  bound where the pair's optimum is at the grid edge).

With every pair's optimum inside the grid, the verdict is the one-axis seed-interval decision
(:mod:`moga.sweep.report.decision`) over the pairs, the reference first: "transfers" when every pair's drift
and regret intervals are within ``max_drift_steps`` and ``max_regret``, "does not transfer" when one is
confidently beyond, "inconclusive" otherwise (one seed always is). With an optimum on the grid's edge, a
divergence of the reused rate still says "does not transfer"; otherwise "no verdict".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moga.files import save_figure
from moga.sweep.report.curves import build_curve, make_grid
from moga.sweep.report.decision import Decision, decide_transfer
from moga.sweep.report.figures import pyplot
from moga.sweep.report.metrics import GROUP_KEYS, transfer_regrets
from moga.sweep.report.schema import SweepRecord, parse_records
from moga.sweep.report.summary import json_safe
from moga.sweep.results import format_lr
from moga.sweep.report.verdict import MAX_REGRET
from moga.verdicts import DOES_NOT_TRANSFER, NO_VERDICT


@dataclass
class JointSummary:
    panel: dict
    metric: str
    scale_keys: list[str]
    pairs: list[tuple]  # ascending; pairs[0] is the reference
    best_lr: dict[tuple, float | None]
    status: dict[tuple, str]  # "ok", "edge" or "all diverged"
    regret: dict[tuple, float | None]  # relative; inf: diverges; None: not run or no optimum
    lower_bound: dict[tuple, bool]
    reference_lr: float | None
    drift_steps: int | None
    verdict: str
    verdict_line: str
    decision: Decision | None = None  # seed intervals over the pairs (None: an edge, or one pair)

    @property
    def title(self) -> str:
        return ", ".join(str(v) for v in self.panel.values() if v not in ("", None))

    def label(self, pair: tuple) -> str:
        return " ".join(f"{k.rsplit('.', 1)[-1]} {v:g}" for k, v in zip(self.scale_keys, pair))

    def to_dict(self) -> dict:
        key = lambda pair: self.label(pair)  # noqa: E731
        return json_safe({
            "panel": self.panel, "metric": self.metric, "scale_keys": self.scale_keys,
            "pairs": [list(p) for p in self.pairs], "reference": list(self.pairs[0]), "reference_lr": self.reference_lr,
            "best_lr": {key(p): v for p, v in self.best_lr.items()}, "status": {key(p): v for p, v in self.status.items()},
            "regret": {key(p): v for p, v in self.regret.items()}, "drift_steps": self.drift_steps,
            "worst_regret": self.worst_regret, "verdict": self.verdict, "line": self.verdict_line,
            "decision": None if self.decision is None else asdict(self.decision),
        })

    @property
    def worst_regret(self) -> float | None:
        values = [v for p, v in self.regret.items() if p != self.pairs[0] and v is not None]
        return max(values) if values else None


def analyze_joint(records: Iterable[SweepRecord | Mapping], scale_keys: Sequence[str], metric: str = "train_loss",
                  group_keys: Sequence[str] = GROUP_KEYS, max_drift_steps: int = 1,
                  max_regret: float = MAX_REGRET) -> list[JointSummary]:
    if len(scale_keys) != 2:
        raise ValueError(f"a joint analysis needs two scale keys, got {list(scale_keys)}")
    records = parse_records(records, scale_keys[0])
    panels: dict[tuple, list[SweepRecord]] = {}
    for r in records:
        panels.setdefault(tuple(r.get(k) for k in group_keys), []).append(r)
    out = []
    for key, rows in panels.items():
        grid = make_grid([r.lr for r in rows])
        by_pair: dict[tuple, list[SweepRecord]] = {}
        for r in rows:
            pair = tuple(float(r.get(k) if r.get(k) is not None else r.scale) for k in scale_keys)
            by_pair.setdefault(pair, []).append(r)
        pairs, curves = [], []
        for i, pair in enumerate(sorted(by_pair)):
            curve = build_curve(float(i + 1), by_pair[pair], metric, grid)
            if curve is not None:
                pairs.append(pair)
                curves.append(curve)
        if not curves:
            continue
        regrets = {pairs[int(r.scale) - 1]: r for r in transfer_regrets(curves)}
        trusted = [c for c in curves if c.trusted]
        steps = [c.best_step for c in trusted]
        s = JointSummary(
            panel=dict(zip(group_keys, key)), metric=metric, scale_keys=list(scale_keys), pairs=pairs,
            best_lr={p: c.best_lr for p, c in zip(pairs, curves)}, status={p: c.status for p, c in zip(pairs, curves)},
            regret={p: (r.relative if r.status in ("ok", "diverges", "reference") else None)
                    for p, r in regrets.items()},
            lower_bound={p: r.lower_bound for p, r in regrets.items()}, reference_lr=curves[0].best_lr,
            drift_steps=(max(steps) - min(steps)) if len(steps) >= 2 and grid.regular else None,
            verdict="", verdict_line="")
        if len(curves) >= 2 and all(c.trusted for c in curves):
            s.decision = decide_transfer(curves, grid.step_log2 if grid.regular else None, max_drift_steps,
                                         max_regret, label=lambda i, s=s: s.label(s.pairs[int(i) - 1]))
        s.verdict, s.verdict_line = decide_joint(s, len(curves), max_drift_steps, max_regret)
        out.append(s)
    return out


def decide_joint(s: JointSummary, n: int, max_drift_steps: int, max_regret: float) -> tuple[str, str]:
    ref = s.label(s.pairs[0])
    if n < 2:
        return NO_VERDICT, f"no verdict: only one pair ({ref})"
    if s.reference_lr is None:
        return NO_VERDICT, f"no verdict: the reference {ref} diverged at every lr"
    others = [p for p in s.pairs[1:]]
    diverges = [s.label(p) for p in others if s.regret.get(p) is not None and math.isinf(s.regret[p])]
    costly = [p for p in others if s.regret.get(p) is not None and s.regret[p] > max_regret]
    edges = [s.label(p) for p in s.pairs if s.status[p] != "ok"]
    share = f"{len(s.pairs) - len(costly)} of {len(s.pairs)} pairs within {100 * max_regret:g}%"
    if s.decision is not None:
        return s.decision.verdict, f"{s.decision.verdict}: {s.decision.reason}; {share} (point estimate)"
    if diverges:
        return DOES_NOT_TRANSFER, (f"does not transfer: reusing {ref}'s best lr ({format_lr(s.reference_lr)}) "
                                     f"diverges at {', '.join(diverges)}; {share}")
    return NO_VERDICT, f"no verdict: the optimum is at the lr grid's edge at {', '.join(edges)}"


def plot_regret_map(summary: JointSummary, path: str | Path, max_regret: float = MAX_REGRET) -> Path:
    """A heat map of the regret of the reused lr over the two scale axes; cells say the value, 'div' or 'n/a'."""
    xs = sorted({p[0] for p in summary.pairs})
    ys = sorted({p[1] for p in summary.pairs})
    grid = np.full((len(ys), len(xs)), np.nan)
    for p in summary.pairs:
        v = summary.regret.get(p)
        if v is not None:
            grid[ys.index(p[1]), xs.index(p[0])] = min(100 * v, 100.0) if math.isfinite(v) else 100.0
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.2 * len(xs) + 2.5, 0.9 * len(ys) + 2))
    image = ax.imshow(grid, origin="lower", cmap="RdYlGn_r", vmin=0, vmax=max(10 * 100 * max_regret, 1e-9))
    for p in summary.pairs:
        v = summary.regret.get(p)
        text = "n/a" if v is None else "div" if math.isinf(v) else f"{100 * v:.1f}%"
        if p == summary.pairs[0]:
            text = f"ref\n{format_lr(summary.reference_lr)}"
        elif summary.status[p] != "ok":
            text += "\nedge"
        ax.text(xs.index(p[0]), ys.index(p[1]), text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
    ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])
    ax.set_xlabel(summary.scale_keys[0])
    ax.set_ylabel(summary.scale_keys[1])
    ax.set_title(f"{summary.title}: regret of the smallest model's lr\n{summary.verdict}", fontsize=10)
    fig.colorbar(image, ax=ax, label="regret, % of the best loss")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=130)
    plt.close(fig)
    return path
