"""`moga coordcheck`: muP's coordinate check, for any optimizer here and torch's AdamW as the control.

For each width (and depth), a fresh model goes forward on one fixed batch at init (step 0), then takes a
few optimizer steps on it. After step t the same batch goes forward again and every layer with a weight
matrix records

- ``output``: the RMS of its output, ``rms(f(x; theta_t))`` (also at step 0);
- ``update``: the RMS of its step's effect on that output, ``rms(f(x; theta_t) - f(x; theta_{t-1}))``, the
  same input ``x`` through the layer before and after its own step;
- ``gain``: ``update`` over the RMS of ``x``: the step's own size, whatever scale the init gave its input
  (a row(2) step changes each output by at most ``lr x rms(x)``, docs/math.md §2.7);
- ``norm``: the size of its weight step ``||W_t - W_{t-1}||`` in its own geometry (the optimizer's role plan;
  MOGA's plan for torch's AdamW). A steepest-descent step has norm ``lr`` by construction (docs/math.md §1.4).

A learning rate transfers across width when these do not depend on it: the slope of ``log value`` against
``log width`` is about 0 (flat). The verdict splits the drift in two parts per layer (:class:`LayerVerdict`):
the output at step 0 (the initialization's doing: nanoGPT's fixed ``N(0, 0.02^2)`` makes every matrix's
output grow like ``sqrt(width)``) and the gain after each step (the optimizer's doing). ``init="width"``
redraws the matrices by a width-aware init (:mod:`moga.models.init`), so that what is left is the
optimizer's. AdamW without width factors is the control: its hidden and readout gains grow like ``width``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from moga.depth import residual_alpha
from moga.geometry import parse_geometry
from moga.models import GPT, ResidualMLP
from moga.models.init import width_aware_init
from moga.optim.muon import MUON_DEFAULT, muon_preset
from moga.optim.registry import OPTIMIZERS as REGISTRY
from moga.roles import build_plan
from moga.train.build import refuse_import

# Deferred on purpose, imported where used: scikit-learn and matplotlib (2.5 s to import), for digits and the figures.

QUANTITIES = ("output", "update", "gain", "norm")
CONTROL = "adamw"  # torch's AdamW: no width factors
OPTIMIZERS = ("moga", "muon", "adamw-scaled", CONTROL)
# Muon as the width paper defines it (the (2, mean) -> (2, mean) norm on every matrix, so each step has norm lr in
# its geometry like MOGA's): moga's all-geometry Muon at its lr 0.02. "muon" alone is the published recipe (AdamW
# on tables, head and vectors) at its own lr 1e-3.
ARMS = ("moga", "muon:preset=moga", "adamw-scaled", CONTROL)
DEFAULT_LR = {"moga": 2**-4, "adamw-scaled": 2**-6, CONTROL: 2**-6}


def default_lr(optimizer: str) -> float:
    """An arm's lr: Muon's is its preset's (``muon:preset=moga`` 0.02, ``muon`` the published 1e-3)."""
    name, options = optimizer_spec(optimizer)
    return muon_preset(options.get("preset", MUON_DEFAULT)).lr if name == "muon" else DEFAULT_LR[name]


@dataclass
class Problem:
    """A model and the fixed batch it trains on; ``loss(model, inputs, targets)`` is the training loss."""

    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


# --- the models ------------------------------------------------------------------------------------------


def _classification_loss(model, x, y):
    out = model(x)
    out = getattr(out, "logits", out[0] if isinstance(out, tuple) else out)
    if y.dtype in (torch.int64, torch.int32):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def _digits(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[:batch], dtype=torch.float32) / 16.0
    return (x - x.mean(0)) / (x.std(0) + 0.1), torch.tensor(digits.target[:batch])


def residual_mlp(width: int, depth: int = 2, seed: int = 0, batch: int = 64) -> Problem:
    """The depth paper's residual MLP on scikit-learn's digits, alpha = K_base / K."""
    x, y = _digits(batch)
    model = ResidualMLP(64, 10, width=width, depth=depth, alpha=residual_alpha(depth), seed=seed)
    return Problem(model, x, y, _classification_loss)


def gpt(width: int, depth: int = 2, seed: int = 0, batch: int = 8) -> Problem:
    """This project's GPT (4 heads, alpha = K_base / K) on a fixed random token sequence."""
    model = GPT(vocab_size=64, block_size=16, n_layer=depth, n_head=4, n_embd=width, alpha=residual_alpha(depth),
                seed=seed)
    tokens = torch.randint(0, 64, (batch, 17), generator=torch.Generator().manual_seed(seed))
    return Problem(model, tokens[:, :-1], tokens[:, 1:], lambda m, x, y: m(x, y)[1])


FAMILIES: dict[str, Callable[..., Problem]] = {"residual_mlp": residual_mlp, "gpt": gpt}


def problem_factory(name: str) -> Callable[..., Problem]:
    """A family name, or ``package.module:factory``: a callable taking ``width`` (and ``depth`` when
    depths are given) that returns an ``nn.Module``, or ``(model, inputs, targets)``."""
    if name in FAMILIES:
        return FAMILIES[name]
    if ":" not in name:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(FAMILIES)} or 'package.module:factory'")

    refuse_import(name, "--model", ", ".join(FAMILIES))
    module, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {attr} from {module}: {e}") from None
    takes = inspect.signature(factory).parameters

    def build(width: int, depth: int | None = None, seed: int = 0, batch: int = 32) -> Problem:
        torch.manual_seed(seed)
        made = factory(width=width, **({"depth": depth} if depth is not None and "depth" in takes else {}))
        if isinstance(made, Problem):
            return made
        model, inputs, targets = made if isinstance(made, tuple) else (made, None, None)
        if inputs is None:
            inputs, targets = _example_batch(model, batch, seed)
        return Problem(model, inputs, targets, _classification_loss)

    return build


def _example_batch(model: nn.Module, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs for a model that came without them, from its first layer; random class targets."""
    g = torch.Generator().manual_seed(seed)
    first = next((m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d))), None)
    if isinstance(first, nn.Linear):
        x = torch.randn(batch, first.in_features, generator=g)
    elif isinstance(first, nn.Embedding):
        x = torch.randint(0, first.num_embeddings, (batch, 16), generator=g)
    elif isinstance(first, nn.Conv2d):
        x = torch.randn(batch, first.in_channels, 16, 16, generator=g)
    else:
        raise ValueError("cannot guess the model's inputs: return (model, inputs, targets) from the factory")
    with torch.no_grad():
        out = model(x)
    out = getattr(out, "logits", out[0] if isinstance(out, tuple) else out)
    return x, torch.randint(0, out.shape[-1], out.shape[:-1], generator=g)


# --- one run ---------------------------------------------------------------------------------------------


@dataclass
class Record:
    optimizer: str
    width: int
    depth: int | None
    step: int  # 0: at init, before any step
    layer: str
    role: str
    output: float
    update: float
    norm: float
    input: float = math.nan  # RMS of the layer's input (NaN for an embedding's indices)
    gain: float = 0.0  # update over input: the step's own size, whatever the input's scale


def rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def tracked_layers(model: nn.Module, plan) -> dict[str, tuple[nn.Module, str, object]]:
    """Layer name -> (module, its weight's name in the plan, plan entry), for every module owning a matrix."""
    entries = {}
    for e in plan:
        if e.role != "vector":
            for name in (e.name, *e.aliases):
                entries[name] = e
    layers = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if full in entries:
                layers[mname] = (module, pname, entries[full])
    return layers


def run_one(problem: Problem, optimizer: str, lr: float, steps: int, width: int, depth: int | None) -> list[Record]:
    """Step 0 (at init), then after each of ``steps`` steps: every tracked layer on the same batch."""
    model = problem.model
    base, options = optimizer_spec(optimizer)
    opt = REGISTRY[base].build(model, lr=lr, **options)
    plan = getattr(opt, "plan", None) or build_plan(model)  # the control is measured in MOGA's geometries
    layers = tracked_layers(model, plan)
    seen: dict[str, tuple] = {}

    def hook(name):
        def record(module, args, kwargs, output):
            seen[name] = (args, kwargs, output)
        return record

    def measure(step: int, before: dict | None) -> list[Record]:
        seen.clear()
        handles = [m.register_forward_hook(hook(name), with_kwargs=True) for name, (m, _, _) in layers.items()]
        try:
            with torch.no_grad():
                problem.loss(model, problem.inputs, problem.targets)  # the same batch every time
        finally:
            for h in handles:
                h.remove()
        out = []
        with torch.no_grad():
            for name, (module, pname, entry) in layers.items():
                args, kwargs, output = seen[name]
                y, x_rms = _tensor(output), _input_rms(args, kwargs)
                if before is None:
                    out.append(Record(optimizer, width, depth, step, name, entry.role, rms(y), 0.0, 0.0, x_rms))
                    continue
                effect = rms(y - _tensor(functional_call(module, before[name], args, kwargs)))
                step_w = getattr(module, pname) - before[name][pname]
                out.append(Record(optimizer, width, depth, step, name, entry.role, rms(y), effect,
                                  _geometry_norm(entry, step_w), x_rms, effect / x_rms if x_rms > 0 else effect))
        return out

    records = measure(0, None)
    for step in range(1, steps + 1):
        before = {name: {p: t.detach().clone() for p, t in m.named_parameters(recurse=False)}
                  for name, (m, _, _) in layers.items()}
        opt.zero_grad(set_to_none=True)
        problem.loss(model, problem.inputs, problem.targets).backward()
        opt.step()
        records += measure(step, before)
    return records


def _tensor(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _input_rms(args, kwargs) -> float:
    """RMS of a layer's first floating input; NaN when it reads indices (an embedding: one-hot inputs, norm 1)."""
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return rms(x) if x is not None and x.is_floating_point() else math.nan


def _geometry_norm(entry, step: torch.Tensor) -> float:
    return float(parse_geometry(entry.geometry).norm(step.double(), entry.layout))


# --- slopes and verdicts: which part drifts ----------------------------------------------------------------


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x; 0 when y is 0 at every x (no width dependence); NaN when
    only some values are 0, or one is not finite."""
    if all(y == 0 for y in ys):
        return 0.0
    if any(not (y > 0 and math.isfinite(y)) for y in ys) or len(xs) < 2:
        return float("nan")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def coord_trend(value: float, tolerance: float) -> str:
    if abs(value) <= tolerance:
        return "flat"
    return "grows" if value > 0 or not math.isfinite(value) else "vanishes"


@dataclass
class LayerVerdict:
    """Two parts per layer, each the slope of log RMS against log width:

    - ``init``: the layer's output at step 0, before any step: the initialization's doing;
    - ``update``: the layer's own step's effect on its output over its input's RMS (``gain``), the
      largest ``|slope|`` over steps 1..t (at ``update_step``): the optimizer's doing, whatever scale
      the init gave the input.

    ``verdict`` names the parts at fault: ``flat``, ``init``, ``optimizer`` or ``init and optimizer``. A
    readout whose output vanishes at init is not at fault (muP's readout: its update sets its scale)."""

    optimizer: str
    depth: int | None
    layer: str
    role: str
    slopes: dict[str, list[float]]  # quantity -> slope at each step, step 0 first
    init: float
    update: float
    update_step: int
    tolerance: float
    verdict: str

    def parts(self) -> dict[str, str]:
        return {"init": coord_trend(self.init, self.tolerance), "optimizer": coord_trend(self.update, self.tolerance)}

    def line(self, name_width: int = 28) -> str:
        p = self.parts()
        return (f"{self.layer:<{name_width}}  {self.role:<9}  init {self.init:+.2f} {p['init']:<8}  update "
                f"{self.update:+.2f} {p['optimizer']:<8} (step {self.update_step})  -> {self.verdict}")


def verdicts(records: list[Record], tolerance: float = 0.1) -> list[LayerVerdict]:
    """One verdict per (optimizer, depth, layer) from the slopes against width at every step."""
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        groups.setdefault((r.optimizer, r.depth, r.layer), []).append(r)
    out = []
    for (optimizer, depth, layer), rs in groups.items():
        steps = sorted({r.step for r in rs})
        slopes = {}
        for q in QUANTITIES:
            slopes[q] = []
            for s in steps:
                at = sorted((r.width, getattr(r, q)) for r in rs if r.step == s)
                slopes[q].append(slope([w for w, _ in at], [v for _, v in at]))
        init = slopes["output"][steps.index(0)] if 0 in steps else 0.0
        stepped = [(abs(v) if math.isfinite(v) else math.inf, v, s) for s, v in zip(steps, slopes["gain"]) if s > 0]
        _, update, at_step = max(stepped) if stepped else (0.0, 0.0, 0)
        role = rs[0].role
        init_trend = coord_trend(init, tolerance)
        faults = [part for part, bad in (
            ("init", init_trend == "grows" or (init_trend == "vanishes" and role != "readout")),
            ("optimizer", coord_trend(update, tolerance) != "flat")) if bad]
        out.append(LayerVerdict(optimizer, depth, layer, role, slopes, init, update, at_step, tolerance,
                                " and ".join(faults) or "flat"))
    return out


# --- the whole check -----------------------------------------------------------------------------------

INITS = ("default", "width")


def coordcheck(model: str = "residual_mlp", optimizers: Sequence[str] = ARMS,
               widths: Sequence[int] = (64, 128, 256, 512, 1024), depths: Sequence[int] | None = None,
               steps: int = 5, lrs: dict[str, float] | None = None, seed: int = 0, tolerance: float = 0.1,
               init: str = "default", progress: Callable[[str], None] | None = None,
               ) -> tuple[list[Record], list[LayerVerdict]]:
    """``init="width"`` redraws every matrix by :func:`moga.models.init.width_aware_init` before the check;
    ``"default"`` keeps the model's own init. ``progress`` gets one line before the runs (how many) and one
    as each run (an optimizer at a width and depth) ends, with its seconds."""
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    unknown = [o for o in optimizers if optimizer_spec(o)[0] not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {', '.join(OPTIMIZERS)}")
    if len(widths) < 2 or any(w < 1 for w in widths):
        raise ValueError(f"give at least two positive widths, got {list(widths)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    build = problem_factory(model)
    records = []
    say = progress or (lambda line: None)
    runs = len(optimizers) * len(depths or [None]) * len(widths)
    say(f"coordcheck: {runs} runs ({len(optimizers)} optimizers x {len(widths)} widths"
        + (f" x {len(depths)} depths" if depths else "") + f") of {steps} steps on {model}; the widest take longest")
    done = 0
    for optimizer in optimizers:
        lr = (lrs or {}).get(optimizer, default_lr(optimizer))
        for depth in depths or [None]:
            for width in widths:
                start = time.perf_counter()
                kwargs = {"width": width, "seed": seed, **({"depth": depth} if depth is not None else {})}
                problem = build(**kwargs)
                if init == "width":
                    width_aware_init(problem.model, seed=seed)
                records += run_one(problem, optimizer, lr, steps, width, depth)
                done += 1
                say(f"  [{done}/{runs}] {optimizer} width {width}" + (f" depth {depth}" if depth is not None else "")
                    + f": {time.perf_counter() - start:.1f} s")
    if not records:  # else: no line printed, no file written, and no word why
        raise ValueError(f"the model {model!r} has no matrices to check (no 2-D weight whose output grows with "
                         "width): a coordinate check needs a model with linear layers")
    return records, verdicts(records, tolerance)


def optimizer_spec(spec: str) -> tuple[str, dict]:
    """``"moga:vectors=sign;p=2.5"`` -> ``("moga", {"vectors": "sign", "p": 2.5})``."""
    name, _, options = spec.partition(":")
    kwargs = {}
    for item in filter(None, options.split(";")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"optimizer option {item!r} in {spec!r} is not key=value")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = value.strip()
    return name.strip(), kwargs
