"""`moga coordcheck`: muP's coordinate check, for any optimizer here and torch's AdamW as the control.

For each width (and depth), a fresh model takes a few optimizer steps on one fixed batch. After step t,
the same batch goes forward again and every layer with a weight matrix records

- ``output``: the RMS of its output, ``rms(f(x; theta_t))``;
- ``update``: the RMS of its update's effect on that output, ``rms(f(x; theta_t) - f(x; theta_{t-1}))``, the
  same input ``x`` through the layer before and after its own step;
- ``norm``: the size of its weight step ``||W_t - W_{t-1}||`` in its own geometry (the optimizer's role plan;
  MOGA's plan for torch's AdamW). A steepest-descent step has norm ``lr`` by construction (docs/math.md §1.4).

A learning rate transfers across width when these do not depend on it: the slope of ``log value`` against
``log width`` is about 0 (flat). The verdict calls a layer flat when ``|slope| <= tolerance`` at every step
for the judged quantities, and says which blow up (slope > tolerance) or vanish. By default it judges the
update's effect, the part the optimizer controls; the output RMS also carries the initialisation (PyTorch's
default init is not muP's: a readout initialised at ``1/sqrt(width)`` moves the logits faster at larger
width through the change of its input, whatever the optimizer), so it is printed and judged on request.
AdamW without width factors is the control: its hidden and readout updates grow like ``width`` (slope 1).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import typer
from torch import nn
from torch.func import functional_call

from moga.depth import residual_alpha
from moga.optim.registry import OPTIMIZERS as REGISTRY
from moga.roles import build_plan

QUANTITIES = ("output", "update", "norm")
JUDGED = ("update",)  # the norm is lr by construction for steepest descent; it is shown, not judged
CONTROL = "adamw"  # torch's AdamW: no width factors
OPTIMIZERS = ("moga", "muon", "adamw-scaled", CONTROL)
DEFAULT_LR = {"moga": 2**-4, "muon": 0.02, "adamw-scaled": 2**-6, CONTROL: 2**-6}


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
    from moga.models import ResidualMLP

    x, y = _digits(batch)
    model = ResidualMLP(64, 10, width=width, depth=depth, alpha=residual_alpha(depth), seed=seed)
    return Problem(model, x, y, _classification_loss)


def gpt(width: int, depth: int = 2, seed: int = 0, batch: int = 8) -> Problem:
    """This project's GPT (4 heads, alpha = K_base / K) on a fixed random token sequence."""
    from moga.models import GPT

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
    from moga.train.build import refuse_import

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
    step: int
    layer: str
    role: str
    output: float
    update: float
    norm: float


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
    model = problem.model
    base, options = optimizer_spec(optimizer)
    opt = REGISTRY[base].build(model, lr=lr, **options)
    plan = getattr(opt, "plan", None) or build_plan(model)  # the control is measured in MOGA's geometries
    layers = tracked_layers(model, plan)
    seen: dict[str, tuple] = {}
    capture = [True]

    def hook(name):
        def record(module, args, kwargs, output):
            if capture[0]:
                seen[name] = (args, kwargs, output)
        return record

    handles = [m.register_forward_hook(hook(name), with_kwargs=True) for name, (m, _, _) in layers.items()]
    records = []
    try:
        for step in range(1, steps + 1):
            before = {name: {p: t.detach().clone() for p, t in m.named_parameters(recurse=False)}
                      for name, (m, _, _) in layers.items()}
            opt.zero_grad(set_to_none=True)
            problem.loss(model, problem.inputs, problem.targets).backward()
            opt.step()
            with torch.no_grad():
                seen.clear()
                problem.loss(model, problem.inputs, problem.targets)  # the same batch, after the step
                capture[0] = False
                for name, (module, pname, entry) in layers.items():
                    args, kwargs, output = seen[name]
                    previous = functional_call(module, before[name], args, kwargs)
                    out = _tensor(output)
                    step_w = getattr(module, pname) - before[name][pname]
                    records.append(Record(
                        optimizer, width, depth, step, name, entry.role, rms(out), rms(out - _tensor(previous)),
                        _geometry_norm(entry, step_w)))
                capture[0] = True
    finally:
        for h in handles:
            h.remove()
    return records


def _tensor(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _geometry_norm(entry, step: torch.Tensor) -> float:
    from moga.geometry import parse_geometry

    return float(parse_geometry(entry.geometry).norm(step.double(), entry.layout))


# --- slopes, verdict, plot ------------------------------------------------------------------------------


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


@dataclass
class LayerVerdict:
    optimizer: str
    depth: int | None
    layer: str
    role: str
    slopes: dict[str, list[float]]  # quantity -> slope at each step
    verdict: str  # "flat", "blows up" or "vanishes"
    worst: str = field(default="")  # the quantity and step with the largest |slope|

    def line(self) -> str:
        last = {q: self.slopes[q][-1] for q in QUANTITIES}
        cells = "  ".join(f"{q} {last[q]:+.2f}" for q in QUANTITIES)
        return f"{self.layer:<28} {self.role:<9} {cells}  {self.verdict}{' (' + self.worst + ')' if self.worst else ''}"


def verdicts(records: list[Record], tolerance: float = 0.1, judged: Sequence[str] = JUDGED) -> list[LayerVerdict]:
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
        scored = [(abs(v) if math.isfinite(v) else math.inf, v, q, s)
                  for q in judged for s, v in zip(steps, slopes[q])]
        size, value, q, s = max(scored)
        verdict = "flat" if size <= tolerance else ("blows up" if value > 0 or not math.isfinite(value) else "vanishes")
        worst = "" if verdict == "flat" else f"{q} slope {value:+.2f} at step {s}"
        out.append(LayerVerdict(optimizer, depth, layer, rs[0].role, slopes, verdict, worst))
    return out


def plot(records: list[Record], path: Path, optimizer: str, depth: int | None = None) -> Path:
    """Writes :func:`figure` to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(records, optimizer, depth)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def figure(records: list[Record], optimizer: str, depth: int | None = None):
    """mup's coord-check figure: a row per quantity, a column per step, value against width per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in records if r.optimizer == optimizer and r.depth == depth]
    steps, layers = sorted({r.step for r in rs}), list(dict.fromkeys(r.layer for r in rs))
    fig, axes = plt.subplots(len(QUANTITIES), len(steps), figsize=(3 * len(steps), 2.6 * len(QUANTITIES)),
                             squeeze=False, sharex=True)
    titles = {"output": "RMS of output", "update": "RMS of update's effect", "norm": "update norm (geometry)"}
    for row, q in enumerate(QUANTITIES):
        for col, s in enumerate(steps):
            ax = axes[row][col]
            for layer in layers:
                at = sorted((r.width, getattr(r, q)) for r in rs if r.step == s and r.layer == layer)
                ax.plot([w for w, _ in at], [v for _, v in at], marker="o", ms=3, label=layer)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{titles[q]}, step {s}", fontsize=8)
            if row == len(QUANTITIES) - 1:
                ax.set_xlabel("width")
    axes[0][-1].legend(fontsize=6, loc="best")
    fig.suptitle(f"coordinate check: {optimizer}" + (f", depth {depth}" if depth is not None else ""))
    fig.tight_layout()
    return fig


# --- the whole check -----------------------------------------------------------------------------------


def coordcheck(model: str = "residual_mlp", optimizers: Sequence[str] = OPTIMIZERS,
               widths: Sequence[int] = (64, 128, 256, 512, 1024), depths: Sequence[int] | None = None,
               steps: int = 5, lrs: dict[str, float] | None = None, seed: int = 0, tolerance: float = 0.1,
               judged: Sequence[str] = JUDGED) -> tuple[list[Record], list[LayerVerdict]]:
    if not judged or set(judged) - set(QUANTITIES):
        raise ValueError(f"judge must name some of {', '.join(QUANTITIES)}, got {list(judged)}")
    unknown = [o for o in optimizers if optimizer_spec(o)[0] not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {', '.join(OPTIMIZERS)}")
    if len(widths) < 2 or any(w < 1 for w in widths):
        raise ValueError(f"give at least two positive widths, got {list(widths)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    build = problem_factory(model)
    records = []
    for optimizer in optimizers:
        lr = (lrs or {}).get(optimizer, DEFAULT_LR[optimizer_spec(optimizer)[0]])
        for depth in depths or [None]:
            for width in widths:
                kwargs = {"width": width, "seed": seed, **({"depth": depth} if depth is not None else {})}
                records += run_one(build(**kwargs), optimizer, lr, steps, width, depth)
    return records, verdicts(records, tolerance, judged)


def report(records: list[Record], found: list[LayerVerdict], out: Path | None) -> str:
    lines = []
    for optimizer in dict.fromkeys(v.optimizer for v in found):
        for depth in dict.fromkeys(v.depth for v in found if v.optimizer == optimizer):
            group = [v for v in found if v.optimizer == optimizer and v.depth == depth]
            bad = [v for v in group if v.verdict != "flat"]
            head = f"{optimizer}" + (f" depth {depth}" if depth is not None else "")
            summary = "all layers flat" if not bad else ", ".join(f"{v.layer} {v.verdict}" for v in bad)
            lines.append(f"== {head}: {summary}")
            lines.append(f"{'layer':<28} {'role':<9} slope of log value vs log width at the last step; verdict")
            lines += [v.line() for v in group]
            if out is not None:
                label = re.sub(r"[^\w.-]+", "_", optimizer)
                name = f"coordcheck_{label}" + (f"_depth{depth}" if depth is not None else "") + ".png"
                lines.append(f"figure: {plot(records, out / name, optimizer, depth)}")
    if out is not None:
        (out / "coordcheck.json").write_text(json.dumps({
            "records": [asdict(r) for r in records], "verdicts": [asdict(v) for v in found]}, indent=1))
    return "\n".join(lines)


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


def _ints(text: str | None) -> list[int] | None:
    return None if not text else [int(v) for v in text.split(",")]


def coordcheck_command(
    model: str = typer.Option("residual_mlp", "--model", "-m",
                              help=f"{', '.join(FAMILIES)}, or package.module:factory taking width (and depth)"),
    optim: str = typer.Option(",".join(OPTIMIZERS), "--optim",
                              help="comma-separated, each with options if any (moga:vectors=sign;p=2.5); "
                                   "adamw is the control"),
    widths: str = typer.Option("64,128,256,512,1024", help="comma-separated widths"),
    depths: str = typer.Option(None, help="comma-separated depths (default: the model's own)"),
    steps: int = typer.Option(5, min=1, help="optimizer steps per width"),
    lr: float = typer.Option(None, help="one learning rate for every optimizer (default: each one's own)"),
    tolerance: float = typer.Option(0.1, help="a layer is flat when |slope| <= tolerance"),
    judge: str = typer.Option(",".join(JUDGED), help="quantities the verdict judges: update, output, norm"),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("runs/coordcheck"), "--out", "-o", help="figures and coordcheck.json go here"),
    no_import: bool = typer.Option(False, "--no-import", help="refuse a package.module:factory model (it would "
                                   "import and run code); also MOGA_NO_IMPORT=1"),
) -> None:
    """muP's coordinate check: per layer, output RMS, update effect and update norm against width after
    each of a few steps; slopes of log RMS vs log width, and a verdict per layer."""
    if no_import:
        from moga.train.cli import refuse_imports

        refuse_imports()
    names = [o.strip() for o in optim.split(",") if o.strip()]
    lrs = {o: lr for o in names} if lr is not None else None
    try:
        records, found = coordcheck(model, names, _ints(widths), _ints(depths), steps, lrs, seed, tolerance,
                                    [q.strip() for q in judge.split(",") if q.strip()])
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    typer.echo(report(records, found, out))
