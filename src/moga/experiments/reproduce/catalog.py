"""The reproductions: one YAML file per claim in ``configs/`` (:mod:`.reproduction`), each of one claim kind
(:mod:`.kinds`). The kinds are registered here, once; the runner, ``--list``, ``--table`` and the recheck find a
reproduction's kind with :func:`kind_of`, and a stored outcome's with :func:`stored_kind`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import yaml

from moga.experiments.reproduce.convergence_claim import CONVERGENCE
from moga.experiments.reproduce.cost import CostCache, cell_cost, cost_cache, data_inputs, grid_estimate
from moga.experiments.reproduce.gap import GAP
from moga.experiments.reproduce.kinds import ClaimKind, kind_registry
from moga.experiments.reproduce.quality import QUALITY
from moga.experiments.reproduce.race import RACE
from moga.experiments.reproduce.reproduction import (
    CONFIGS, SCALES, ReproduceError, Reproduction, merge, read_reproduction, tune_settings
)
from moga.experiments.reproduce.transfer import JOINT, TRANSFER
from moga.experiments.reproduce.tune_claim import TUNE

__all__ = ["KINDS", "SCALES", "ReproduceError", "Reproduction", "catalog", "cell_cost", "data_inputs", "describe",
           "cost_cache", "estimate", "get", "kind_of", "merge", "stored_kind", "tune_settings"]

KINDS: dict[str, ClaimKind] = kind_registry(TRANSFER, JOINT, RACE, CONVERGENCE, QUALITY, GAP, TUNE)


def kind_of(rep: Reproduction) -> ClaimKind:
    return KINDS[rep.kind]


def stored_kind(outcome: dict) -> ClaimKind:
    """The kind of a stored outcome, from its shape (``outcome.json`` names no kind)."""
    found = [k for k in KINDS.values() if k.stores(outcome)]
    if len(found) != 1:
        raise ReproduceError(f"a stored outcome (keys {', '.join(sorted(outcome)[:8])}) is of "
                             f"{'no kind that rechecks' if not found else 'several kinds'}")
    return found[0]


@lru_cache(maxsize=1)
def catalog() -> dict[str, Reproduction]:
    out = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        rep = read_reproduction(path)
        if rep.kind not in KINDS:
            raise ReproduceError(f"{path.name}: kind must be one of {tuple(KINDS)}, got {rep.kind!r}")
        out[rep.name] = rep
    order = ["depth-mlp", "depth-gpt", "depth-resnet", "width-gpt", "width-mlp", "race", "convergence", "joint", "quality",
             "gap-width", "tune"]
    return {n: out[n] for n in sorted(out, key=lambda n: order.index(n) if n in order else len(order))}


def get(name: str) -> Reproduction:
    items = catalog()
    if name not in items:
        raise ReproduceError(f"no reproduction {name!r}; the reproductions are {', '.join(items)} (or all)")
    return items[name]


def estimate(rep: Reproduction, scale: str = "cpu", cores: int = 2, min_seeds: int = 3, max_seeds: int = 6,
             cache: CostCache | None = None) -> dict:
    """Cells and estimated wall time on ``cores`` free cores (one worker each) of a quiet CPU: the grid's
    (``cells``, ``seconds``), and the range the added seeds cost (``seed_cells``, ``seed_seconds``: (low, high)).
    Low: every panel decided with ``min_seeds`` seeds at 3 rates per scale; high: every panel inconclusive,
    ``max_seeds`` seeds at 5 rates. A race adds ``min_seeds`` seeds at each contender's best rate per budget.
    ``cache``: where each cell's cost is kept between calls (:func:`.cost.cost_cache`)."""
    kind = kind_of(rep)
    if kind.estimate is not None:
        return kind.estimate(rep, scale, cores, min_seeds, max_seeds, cache)
    return grid_estimate(rep, scale, cores, min_seeds, max_seeds, kind.seeds_added, kind.curves, cache)


def describe(value: Any) -> str:
    return value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
