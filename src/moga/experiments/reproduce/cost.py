"""What a reproduction costs, for ``moga reproduce --list`` and ``moga tune``'s budgets: each cell's parameters,
training FLOPs and steps from its model built on the meta device, and a wall-time estimate calibrated on a quiet
2-core CPU."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import torch
from torch import nn

import moga

from moga.experiments.reproduce.reproduction import merge, tune_settings
from moga.data import cache_dir
from moga.experiments.smoothness.convergence import convergence_settings
from moga.files import write_json
from moga.geometry import parse_geometry
from moga.layout import resolve_layout
from moga.models import GPT
from moga.roles import build_plan
from moga.sweep.branch import Branches
from moga.sweep.spec import cell_id
from moga.train.build import model_from_config
from moga.train.config import build_config

# Calibrated on `moga demo` (108 residual-MLP runs, 1.4e13 training FLOPs), which took 420 s with 2 workers on
# a quiet 2-core CPU; this model gives it 8 minutes. Used for estimates only.
CPU_FLOPS_PER_CORE = 20e9
# The convergence experiment's batch-512, width-512 matmuls run far faster: calibrated on its default run
# (Fashion-MNIST and CIFAR-10), which took 153 s on the same 2 cores (README, "Smoothness").
GD_FLOPS_PER_CORE = 115e9
CELL_OVERHEAD_S = 2.0  # process start, data loading, the final evaluation
STEP_OVERHEAD_S = 3e-4  # Python and kernel launches per optimizer step, per residual block
# What each data set hands the model (moga.train.tasks), and its training split (for epoch-length runs).
DATA_INPUTS = {
    "digits": ({"in_features": 64, "out_features": 10, "num_classes": 10, "in_channels": 1}, 1617),
    "fashion-mnist": ({"in_features": 784, "out_features": 10, "num_classes": 10, "in_channels": 1}, 55000),
    "cifar10": ({"in_features": 3072, "out_features": 10, "num_classes": 10, "in_channels": 3}, 45000),
    "cifar100": ({"in_features": 3072, "out_features": 100, "num_classes": 100, "in_channels": 3}, 45000),
}
SOURCE = Path(moga.__file__).parent  # every module a cost depends on is in it
TEXT_VOCAB = {"char": 65, "byte": 256, "gpt2": 50257}  # tiny Shakespeare has 65 characters



def cell_cost(config, cache: CostCache | None = None) -> dict:
    """Parameters, training FLOPs (6 x parameters x examples or tokens, plus attention) and steps of one cell,
    from the model built on the meta device (no memory); with ``cache`` (:func:`cost_cache`, which
    ``moga reproduce --list`` passes) each model is built once per config and code, not once per call."""
    if cache is None:
        return _built_cost(config)
    key = config.hash()
    if key not in cache.costs:
        cache.costs[key] = _built_cost(config)
        cache.save()
    return dict(cache.costs[key])


@dataclass
class CostCache:
    path: Path
    costs: dict[str, dict]

    def save(self) -> None:
        with contextlib.suppress(OSError):  # a read-only cache only costs the next call the builds again
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, self.costs, indent=None)


def cost_cache() -> CostCache:
    """The costs computed so far, by config hash, in ``$MOGA_CACHE/reproduce`` (default ~/.cache/moga): one file
    per version of moga's source, torch and transformers, so a change to a model's code is never read stale."""
    path = cache_dir() / "reproduce" / f"costs-{_code_version()}.json"
    try:
        costs = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or damaged: built again
        costs = {}
    return CostCache(path, costs if isinstance(costs, dict) else {})


@lru_cache(maxsize=1)
def _code_version() -> str:
    digest = hashlib.sha256(f"{torch.__version__} {_version('transformers')}".encode())
    for path in sorted(SOURCE.rglob("*.py")):
        digest.update(path.relative_to(SOURCE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def _built_cost(config) -> dict:
    d = config.data
    inputs, train_size = data_inputs(config)
    if config.model.depth_scaling != "none":  # the same parameters; a meta model cannot run the scaling's probe
        raw = config.to_dict()
        config = build_config({**raw, "model": {**raw["model"], "depth_scaling": "none"}})
    try:
        with torch.device("meta"):
            model = model_from_config(config, inputs, scale_depth=False)  # the scale's proof costs 5 s a model
    except ImportError:  # an optional integration (transformers) is missing: a GPT of the same size stands in
        m = config.model.kwargs
        with torch.device("meta"):
            model = GPT(**{k: m[k] for k in ("n_layer", "n_embd") if k in m}, **inputs)
    params = sum(p.numel() for p in model.parameters())
    batch = config.train.batch_size if config.train.batch_size != "full" else train_size
    per_step = batch * (d.block_size if d.kind == "text" else 1)
    steps = config.train.steps or math.ceil((config.train.epochs or 1) * train_size / batch)
    flops = 6 * params * per_step * steps
    if d.kind == "text":  # attention scores and their backward: 12 x layers x context x width per token
        m = config.model.kwargs
        flops += 12 * m.get("n_layer", 1) * d.block_size * m.get("n_embd", 0) * per_step * steps
    if config.model.name == "resnet":  # convolutions: params x output positions, not params
        flops = 6 * _conv_macs(model, inputs) * batch * steps
    flops += steps * orthogonalization_flops(model, config.optim.geometries or {})
    depth = getattr(model, "depth", 1) or 1
    seconds = flops / CPU_FLOPS_PER_CORE + steps * STEP_OVERHEAD_S * depth + CELL_OVERHEAD_S
    return {"params": params, "flops": float(flops), "steps": steps, "seconds": seconds}


def orthogonalization_flops(model, geometries: dict) -> float:
    """One step's Newton-Schulz work on the roles ``geometries`` sets to spectral: per matrix (a x b, a <= b)
    ``steps`` iterations of ``X X^T`` (2 a^2 b), ``A A`` (2 a^3) and ``B X`` (2 a^2 b)."""
    roles = {role: parse_geometry(spec) for role, spec in geometries.items() if spec.startswith("spectral")}
    if not roles:
        return 0.0
    total = 0.0
    for e in build_plan(model, geometries).entries:
        if e.role in roles:
            lay = resolve_layout(e.layout, e.param)
            m, n = lay.fan_out(e.shape), lay.fan_in(e.shape)
            a, b = min(m, n), max(m, n)
            total += e.param.numel() // (m * n) * roles[e.role].steps * (4 * a * a * b + 2 * a ** 3)
    return float(total)


def data_inputs(config) -> tuple[dict, int]:
    d = config.data
    if d.kind == "text":
        tokens = 1_003_854  # tiny Shakespeare's training split; only epoch-length runs need it
        return {"vocab_size": TEXT_VOCAB[d.tokenizer], "block_size": d.block_size}, tokens
    inputs, size = DATA_INPUTS.get(d.name, DATA_INPUTS["cifar10"])
    if d.limit_per_class:
        size = d.limit_per_class * inputs["num_classes"]
        if isinstance(d.val_size, float):
            size = int(size * (1 - d.val_size))
    return dict(inputs), size


def _conv_macs(model, inputs: dict) -> float:
    """Multiply-adds of one forward pass of a CIFAR ResNet on a 32x32 image (meta tensors: shapes only)."""
    macs = 0.0

    def hook(module, args, output):
        nonlocal macs
        if isinstance(module, nn.Conv2d):
            macs += module.weight.numel() * output.shape[-1] * output.shape[-2]
        elif isinstance(module, nn.Linear):
            macs += module.weight.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.device("meta"):
        model(torch.empty(1, inputs["in_channels"], 32, 32))
    for h in handles:
        h.remove()
    return macs


# The decisive rates of a panel at one scale (moga.sweep.seeds): the argmin and its two neighbours, plus the two
# rates around the reference's optimum, which often coincide with them.
DECISIVE_RATES = (3, 5)


def grid_estimate(rep, scale: str, cores: int, min_seeds: int, max_seeds: int, seeds_added, curves=None,
                  cache: CostCache | None = None) -> dict:
    """Cells and estimated wall time of a reproduction's lr grid on ``cores`` free cores (one worker each) of a
    quiet CPU: the grid's (``cells``, ``seconds``), and the range the added seeds cost (``seed_cells``,
    ``seed_seconds``: (low, high)); ``seeds_added(count, min_seeds, max_seeds)`` gives a curve's [low, high]
    seed cells, and ``curves``, where given, the cells that run on each curve (the kind's, :mod:`.kinds`)."""
    sweep = rep.sweep(scale)
    seen: dict[str, dict] = {}
    costs = []
    curve_cells: dict[str, tuple[int, float]] = {}  # cells that differ only in lr and seed (one curve of one panel
    # at one scale): how many, and the cost of one (they train the same model for the same steps)
    branches = Branches(sweep, Path)  # the plan alone: which cells run only their cooldown
    for c in sweep.cells:  # cells that differ only in optimizer settings or seed cost the same: one model each
        key = json.dumps({k: v for k, v in c.items() if (not k.startswith("optim.") or k.startswith("optim.geometries"))
                          and k != "seed"}, sort_keys=True)
        if key not in seen:
            seen[key] = cell_cost(sweep.config(c), cache)
        cost, point = seen[key], branches.points.get(cell_id(c))
        if point is not None:  # only its cooldown runs
            share = 1 - point[1] / cost["steps"]
            cost = {**cost, "flops": cost["flops"] * share, "seconds": cost["seconds"] * share}
        costs.append(cost)
        curve = json.dumps({k: v for k, v in c.items() if k not in ("optim.lr", "seed")}, sort_keys=True)
        curve_cells[curve] = (curve_cells.get(curve, (0, 0.0))[0] + 1, cost["seconds"])
    cells, seconds_total = len(sweep.cells), sum(c["seconds"] for c in costs) / cores
    if curves is not None:
        curve_cells = curves(rep, scale, sweep, curve_cells)
        cells = sum(n for n, _ in curve_cells.values())
        seconds_total = sum(n * s for n, s in curve_cells.values()) / cores
    seed_cells, seed_seconds = [0, 0], [0.0, 0.0]
    for count, seconds in curve_cells.values():
        added = seeds_added(count, min_seeds, max_seeds)
        for i in (0, 1):
            seed_cells[i] += added[i]
            seed_seconds[i] += added[i] * seconds / cores
    return {"cells": cells, "seconds": seconds_total,
            "flops": sum(c["flops"] for c in costs), "seed_cells": tuple(seed_cells),
            "seed_seconds": tuple(seed_seconds)}


def decisive_rate_seeds(count: int, min_seeds: int, max_seeds: int) -> list[int]:
    """Low: the panel decided with ``min_seeds`` seeds at 3 rates per scale; high: inconclusive, ``max_seeds``
    seeds at 5 rates."""
    return [min(r, count) * (n - 1) for r, n in zip(DECISIVE_RATES, (min_seeds, max_seeds))]


def best_rate_seeds(count: int, min_seeds: int, max_seeds: int) -> list[int]:
    """One curve per contender and budget or width: its best rate gets ``min_seeds`` seeds."""
    return [min_seeds - 1] * 2


def tune_estimate(rep, scale: str, cores: int, min_seeds: int, max_seeds: int, cache: CostCache | None = None) -> dict:
    """moga tune's budget per target (its proxies cost at most that) plus the target's check: 3 rates x seeds."""
    s = tune_settings(rep, scale)
    flops = seconds = 0.0
    for target in s["targets"].values():
        cost = cell_cost(build_config(merge(copy.deepcopy(s["base"]), {"model": target["model"]})), cache)
        flops += s["budget_flops"] + 3 * min_seeds * cost["flops"]
        seconds += s["budget_flops"] / CPU_FLOPS_PER_CORE + 3 * min_seeds * cost["seconds"]
    return {"cells": None, "seconds": seconds / cores, "flops": flops, "seed_cells": (0, 0),
            "seed_seconds": (0.0, 0.0)}


def convergence_estimate(rep, scale: str, cores: int, min_seeds: int, max_seeds: int, cache=None) -> dict:
    s = convergence_settings(**rep.settings(scale))
    return {"cells": None, "seconds": _convergence_seconds(s) / cores, "flops": None,
            "seed_cells": (0, 0), "seed_seconds": (0.0, 0.0)}


def _convergence_seconds(s: dict) -> float:
    """The convergence experiment's runs: full-batch-ish GD on feedforward nets of width ``width``."""
    sizes = {d: DATA_INPUTS.get(d, DATA_INPUTS["cifar10"]) for d in s["data"]}
    total = 0.0
    for d, (inputs, n) in sizes.items():
        params = inputs["in_features"] * s["width"] + (s["depth"] - 2) * s["width"] ** 2 + s["width"] * 10
        epochs = s["cifar_epochs"] if d.startswith("cifar") else s["epochs"]
        range_examples = s["range_lrs"] * s["range_steps"] * s["batch_size"]
        total += 6 * params * (n * epochs * (1 + s["constant_rates"]) * s["seeds"] + range_examples)
    inputs, n = sizes[s["data"][0]]
    shared = inputs["in_features"] * s["width"]  # the shared-weights net's only weights
    for L in s["shared_depths"]:
        total += 6 * shared * L / 2 * (n * s["shared_epochs"] * 3 * s["seeds"]
                                       + s["range_lrs"] * s["range_steps"] * s["batch_size"])
    total += 6 * shared * n * s["long_epochs"] * 2 * s["seeds"]
    return total / GD_FLOPS_PER_CORE
