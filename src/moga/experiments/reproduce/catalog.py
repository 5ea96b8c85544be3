"""The reproductions as data: one YAML file per claim in ``configs/``, read into :class:`Reproduction`.

A file names the paper, figure and claim, the kind of analysis (``transfer``: an lr sweep and its transfer
verdicts; ``joint``: the same over two scale axes; ``race``: time and tokens to a loss; ``convergence``: the
convergence paper's experiment), what the paper expects of each panel, and a ``sweep`` shared by every scale.
``scales.quick`` / ``cpu`` / ``paper`` each deep-merge their own ``sweep`` into it (an axis or an exclusion
list given there replaces the shared one whole), name their default data set, and for the paper scale say
where the setup comes from (``source``) and what the paper's text leaves open (``silent``).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from moga.experiments.smoothness.convergence import convergence_settings
from moga.geometry import parse_geometry
from moga.layout import resolve_layout
from moga.models import GPT
from moga.roles import build_plan
from moga.sweep.spec import Sweep
from moga.train.build import build_model
from moga.train.config import build_config

CONFIGS = Path(__file__).parent / "configs"
SCALES = ("quick", "cpu", "paper")
KINDS = ("transfer", "joint", "race", "convergence", "quality", "gap", "tune")
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
TEXT_VOCAB = {"char": 65, "byte": 256, "gpt2": 50257}  # tiny Shakespeare has 65 characters


class ReproduceError(ValueError):
    """A reproduction that does not exist or cannot be set up as asked."""


@dataclass
class Reproduction:
    name: str
    paper: str
    figure: str
    claim: str
    kind: str
    raw: dict = field(repr=False)

    @property
    def expect(self) -> list[dict]:
        return list(self.raw.get("expect", []))

    @property
    def group_keys(self) -> list[str]:
        return list(self.raw.get("group_keys", ["optimizer", "scaling"]))

    def scale(self, scale: str) -> dict:
        if scale not in SCALES:
            raise ReproduceError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
        return dict(self.raw.get("scales", {}).get(scale) or {})

    def sweep_dict(self, scale: str = "cpu", data: str | None = None) -> dict:
        """The sweep config of one scale; ``data`` replaces the data set (a name, or for text a file or
        a prepared directory)."""
        if self.kind == "convergence":
            raise ReproduceError(f"{self.name} is not a sweep")
        s = self.scale(scale)
        spec = merge(copy.deepcopy(self.raw["sweep"]), s.get("sweep", {}))
        spec["name"] = f"{self.name}-{scale}"
        spec.setdefault("base", {}).setdefault("data", {})
        chosen = data or s.get("data")
        if chosen is not None:
            apply_data(spec["base"]["data"], chosen)
        return spec

    def sweep(self, scale: str = "cpu", data: str | None = None):
        return Sweep.from_dict(self.sweep_dict(scale, data))

    def settings(self, scale: str = "cpu", data: str | None = None) -> dict:
        """Settings of the convergence experiment (moga.experiments.smoothness.convergence)."""
        s = dict(self.scale(scale).get("settings", {}))
        if data:
            s["data"] = [d.strip() for d in data.split(",")]
        return s


def merge(base: dict, over: dict) -> dict:
    """Deep merge; under ``axes`` each axis is replaced whole, and lists are replaced."""
    for key, value in over.items():
        if key == "axes" and isinstance(value, dict):
            base.setdefault("axes", {}).update(copy.deepcopy(value))
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def apply_data(section: dict, data: str) -> None:
    if section.get("name") == "text":
        path = Path(data).expanduser()
        if path.is_dir():
            section["data_dir"] = str(path)
        elif path.suffix or path.exists():
            section["text_path"] = str(path)
        else:
            raise ReproduceError(f"--data for a text reproduction is a text file or a directory with "
                                 f"train.bin/val.bin, got {data!r}")
        return
    section["name"] = data


@lru_cache(maxsize=1)
def catalog() -> dict[str, Reproduction]:
    out = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        missing = {"name", "paper", "figure", "claim", "kind"} - set(raw)
        if missing:
            raise ReproduceError(f"{path.name}: missing {sorted(missing)}")
        if raw["kind"] not in KINDS:
            raise ReproduceError(f"{path.name}: kind must be one of {KINDS}, got {raw['kind']!r}")
        out[raw["name"]] = Reproduction(raw["name"], raw["paper"], str(raw["figure"]), raw["claim"], raw["kind"], raw)
    order = ["depth-mlp", "depth-gpt", "depth-resnet", "width-gpt", "width-mlp", "race", "convergence", "joint", "quality",
             "gap-width", "tune"]
    return {n: out[n] for n in sorted(out, key=lambda n: order.index(n) if n in order else len(order))}


def get(name: str) -> Reproduction:
    items = catalog()
    if name not in items:
        raise ReproduceError(f"no reproduction {name!r}; the reproductions are {', '.join(items)} (or all)")
    return items[name]


# --- cost ----------------------------------------------------------------------------------------------------

def cell_cost(config) -> dict:
    """Parameters, training FLOPs (6 x parameters x examples or tokens, plus attention) and steps of one cell,
    from the model built on the meta device (no memory, no time)."""
    d = config.data
    inputs, train_size = data_inputs(config)
    if config.model.depth_scaling != "none":  # the same parameters; a meta model cannot run the scaling's probe
        raw = config.to_dict()
        config = build_config({**raw, "model": {**raw["model"], "depth_scaling": "none"}})
    try:
        with torch.device("meta"):
            model = build_model(config, inputs, scale_depth=False)  # the scale's proof costs 5 s a model
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


def estimate(rep: Reproduction, scale: str = "cpu", cores: int = 2, min_seeds: int = 3, max_seeds: int = 6) -> dict:
    """Cells and estimated wall time on ``cores`` free cores (one worker each) of a quiet CPU: the grid's
    (``cells``, ``seconds``), and the range the added seeds cost (``seed_cells``, ``seed_seconds``: (low, high)).
    Low: every panel decided with ``min_seeds`` seeds at 3 rates per scale; high: every panel inconclusive,
    ``max_seeds`` seeds at 5 rates. A race adds ``min_seeds`` seeds at each contender's best rate per budget."""
    if rep.kind == "tune":
        return _tune_estimate(rep, scale, cores, min_seeds)
    if rep.kind == "convergence":
        s = convergence_settings(**rep.settings(scale))
        return {"cells": None, "seconds": _convergence_seconds(s) / cores, "flops": None,
                "seed_cells": (0, 0), "seed_seconds": (0.0, 0.0)}
    sweep = rep.sweep(scale)
    seen: dict[str, dict] = {}
    costs = []
    curves: dict[str, tuple[int, float]] = {}  # cells that differ only in lr and seed (one curve of one panel at
    # one scale): how many, and the cost of one (they train the same model for the same steps)
    for c in sweep.cells:  # cells that differ only in optimizer settings or seed cost the same: one model each
        key = json.dumps({k: v for k, v in c.items() if (not k.startswith("optim.") or k.startswith("optim.geometries"))
                          and k != "seed"}, sort_keys=True)
        if key not in seen:
            seen[key] = cell_cost(sweep.config(c))
        costs.append(seen[key])
        curve = json.dumps({k: v for k, v in c.items() if k not in ("optim.lr", "seed")}, sort_keys=True)
        curves[curve] = (curves.get(curve, (0, 0.0))[0] + 1, seen[key]["seconds"])
    cells, seconds_total = len(sweep.cells), sum(c["seconds"] for c in costs) / cores
    if rep.kind == "gap":  # from narrow_from on, 3 rates per curve (a width's cells: moga.experiments.reproduce.gap)
        narrow = {**rep.raw.get("gap", {}), **rep.scale(scale).get("gap", {})}.get("narrow_from", math.inf)
        key = sweep.spec.scale_key
        curves = {k: (min(n, 3) if json.loads(k)[key] >= narrow else n, s) for k, (n, s) in curves.items()}
        cells = sum(n for n, _ in curves.values())
        seconds_total = sum(n * s for n, s in curves.values()) / cores
    seed_cells, seed_seconds = [0, 0], [0.0, 0.0]
    for count, seconds in curves.values():
        if rep.kind in ("transfer", "joint"):
            added = [min(r, count) * (n - 1) for r, n in zip(DECISIVE_RATES, (min_seeds, max_seeds))]
        elif rep.kind in ("race", "gap"):  # one curve per contender and budget or width; its best rate gets the seeds
            added = [min_seeds - 1] * 2
        else:  # quality: the grid already has its seeds
            added = [0, 0]
        for i in (0, 1):
            seed_cells[i] += added[i]
            seed_seconds[i] += added[i] * seconds / cores
    return {"cells": cells, "seconds": seconds_total,
            "flops": sum(c["flops"] for c in costs), "seed_cells": tuple(seed_cells),
            "seed_seconds": tuple(seed_seconds)}


def tune_settings(rep: Reproduction, scale: str) -> dict:
    """A tune claim's settings (``tune:``) with its scale's own ``tune:`` merged in."""
    return merge(copy.deepcopy(rep.raw.get("tune", {})), rep.scale(scale).get("tune", {}))


def _tune_estimate(rep: Reproduction, scale: str, cores: int, min_seeds: int) -> dict:
    """moga tune's budget per target (its proxies cost at most that) plus the target's check: 3 rates x seeds."""
    s = tune_settings(rep, scale)
    flops = seconds = 0.0
    for target in s["targets"].values():
        cost = cell_cost(build_config(merge(copy.deepcopy(s["base"]), {"model": target["model"]})))
        flops += s["budget_flops"] + 3 * min_seeds * cost["flops"]
        seconds += s["budget_flops"] / CPU_FLOPS_PER_CORE + 3 * min_seeds * cost["seconds"]
    return {"cells": None, "seconds": seconds / cores, "flops": flops, "seed_cells": (0, 0),
            "seed_seconds": (0.0, 0.0)}


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


def describe(value: Any) -> str:
    return value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
