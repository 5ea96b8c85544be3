"""Seeds where the decision is close: after the grid's one seed, more seeds on each panel's decisive rates.

Used by ``moga reproduce`` and ``moga demo`` (:func:`run_until_decided`); the same rule serves any sweep.

The decisive rates of a panel at a scale are its seed-mean argmin, the argmin's two neighbours and the two
grid rates around the reference scale's refined optimum (where the regret is read). A panel that is
decided keeps ``min_seeds`` seeds there (one seed is an anecdote); an inconclusive one gets as many as its
interval says would decide it, at most ``max_seeds``. A panel with an optimum on its grid's edge gets none:
the grid has to grow first. The added cells are the sweep's ``include`` entries (grid cells with a
``seed``), so they run on the same resumable store.
"""

from __future__ import annotations

from collections.abc import Sequence

from moga.sweep.report import analyze
from moga.sweep.report.decision import decisive_rates
from moga.sweep.report.schema import parse_records
from moga.sweep.report.summary import PanelSummary
from moga.sweep.results import records
from moga.sweep.spec import Sweep, canonical, cell_id
from moga.sweep.store import SweepStore
from moga.verdicts import INCONCLUSIVE


def decisive_lrs(p: PanelSummary) -> dict[float, list[float]]:
    """scale -> the rates whose seeds decide the panel."""
    if p.decision is None:
        return {}
    x_ref = p.decision.scales[0].optimum_log2
    return {c.scale: decisive_rates(c, x_ref) for c in p.curves}


def wanted_seeds(p: PanelSummary, min_seeds: int, max_seeds: int) -> int:
    d = p.decision
    if d is None:
        return 0
    if d.verdict == INCONCLUSIVE:
        return max(min_seeds, min(max_seeds, d.seeds_to_decide or max_seeds))
    return min_seeds


def more_seeds(summaries: Sequence[PanelSummary], rows: list[dict], scale_key: str, group_keys: Sequence[str],
               params_of, min_seeds: int = 3, max_seeds: int = 6) -> list[dict]:
    """The cells to add (grid cell params plus ``seed``) so that every panel has the seeds it needs.

    ``rows`` are the sweep's records (``moga.sweep.results.records``, with ``scale_key`` filled in) and
    ``params_of(cell_id)`` gives a stored cell's params."""
    records = parse_records(rows, scale_key)
    have: dict[tuple, set[int]] = {}
    grid_cell: dict[tuple, str] = {}
    for r in records:
        key = (tuple(str(r.get(k)) for k in group_keys), float(r.scale), float(r.lr))
        have.setdefault(key, set()).add(r.seed)
        grid_cell.setdefault(key, r.get("cell"))
    out = []
    for p in summaries:
        n = wanted_seeds(p, min_seeds, max_seeds)
        panel = tuple(str(p.panel.get(k)) for k in group_keys)
        for scale, lrs in decisive_lrs(p).items():
            for lr in lrs:
                key = (panel, float(scale), float(lr))
                if key not in grid_cell:
                    continue
                base = {k: v for k, v in params_of(grid_cell[key]).items() if k != "seed"}
                first = min(have[key])
                for seed in range(first, first + n):
                    if seed not in have[key]:
                        out.append({**base, "seed": seed})
    return out


def stored_include(out, make_sweep) -> list[dict]:
    """The seeds an earlier run of this sweep directory added (they stay in the grid when it resumes).

    The store is data, not config: each recorded entry must be a cell that ``make_sweep([])`` (the config
    alone) makes, or one of them with another integer ``seed``. Anything else (a changed model name, say)
    is refused as a damaged store, never run."""
    store = SweepStore(out)
    if not store.exists():
        return []
    include = store.definition()["spec"].get("include") or []
    own = make_sweep([]).cells
    cells = {canonical(c) for c in own}
    bases = {canonical({k: v for k, v in c.items() if k != "seed"}) for c in own}
    for entry in include if isinstance(include, list) else [include]:
        seed = entry.get("seed") if isinstance(entry, dict) else None
        if isinstance(entry, dict) and (canonical(entry) in cells or (
                type(seed) is int and canonical({k: v for k, v in entry.items() if k != "seed"}) in bases)):
            continue
        raise store.damaged(f"its recorded include: entry {str(entry)[:200]} is not a cell of this sweep's "
                            "config (or one with another seed)")
    return list(include)


def run_until_decided(make_sweep, out, run, rows_of, group_keys: Sequence[str], max_regret: float,
                      min_seeds: int = 3, max_seeds: int = 6):
    """Run the grid (``make_sweep(include)`` builds the sweep, ``run(sweep)`` runs it and returns its counts),
    then add seeds until no panel wants more; returns (sweep, counts, the last round's panel summaries, empty
    when ``max_seeds`` asks for no round). ``rows_of(sweep)`` gives the records and their scale key. Resumable:
    the seeds already added are read back from the store."""
    include = stored_include(out, make_sweep)
    sweep = make_sweep(include)
    counts = run(sweep)
    summaries = []
    while max_seeds > 1:
        rows, scale_key = rows_of(sweep)
        summaries = analyze(rows, scale_key=scale_key, group_keys=group_keys, max_regret=max_regret)
        params = {c["id"]: c["params"] for c in SweepStore(out).cells()}
        extra = more_seeds(summaries, rows, scale_key, group_keys, params.__getitem__, min_seeds, max_seeds)
        if not extra:
            break
        include = include + extra
        sweep = make_sweep(include)
        counts = run(sweep)
    return sweep, counts, summaries


def run_sweep_until_decided(sweep, out, run, group_keys: Sequence[str], max_regret: float, min_seeds: int = 3,
                            max_seeds: int = 6):
    """:func:`run_until_decided` for a user's own sweep (``moga sweep --seeds``): the panels are ``group_keys``
    (as in ``moga report --by``), one curve per value of the spec's ``scale_key``. The spec's own ``include``
    cells stay; the added seeds join them. Returns (sweep, counts, one line per panel that got no seeds and
    why), so that a panel left at one seed is said, not silent."""
    scale_key = sweep.spec.scale_key
    own = list(sweep.spec.include)

    def make(include):
        ids = {cell_id(c) for c in own}
        merged = own + [c for c in include if cell_id(c) not in ids]
        return Sweep(sweep.spec.model_copy(update={"include": merged}), sweep.base, sweep.source)

    sweep, counts, summaries = run_until_decided(make, out, run, lambda sw: (records(SweepStore(out)), scale_key),
                                                 group_keys, max_regret, min_seeds, max_seeds)
    return sweep, counts, [f"no seeds added to {p.title or 'the sweep'}: {p.verdict_line}" for p in summaries
                           if p.decision is None]
