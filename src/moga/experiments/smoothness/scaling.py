"""Experiments 1 and 2 of ``moga smoothness``: the block Lipschitz and smoothness constants against depth and width.

Depth (the depth paper, Theorems 1-2): residual MLPs and small GPTs at K = 2 .. 64 residual blocks, unscaled
(``alpha = 1``) and with ``alpha = K_base / K`` (``K_base = 2``), measured at initialization and after a short
MOGA training run. The paper predicts both constants flat in K with ``alpha = K_base/K``; with ``alpha = 1``
its worst-case bound grows like ``(1 + C)^K``.

Width (the width paper, Theorem 2): a residual MLP of two blocks at widths 64 .. 1024, its matrices measured in
the row(2), col(2), sign and spectral geometries (the same geometry on the input, hidden and readout matrices),
at initialization and after training with MOGA. The paper predicts row, col and sign flat in width and
spectral possibly growing like ``sqrt(width)``.

Every point is :func:`moga.smoothness.measure` on one fixed probe batch of the training split (model in
``eval()``): the exact Lipschitz constant ``||grad||_block,*`` and a lower bound on the smoothness from
alternating LMO ascent. The block holds the weight matrices only (biases, gains and embedding tables held
fixed) unless ``full_block`` adds the block of every parameter: in a GPT the token table dominates the full
block's constants, which would hide what the residual branches do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moga.experiments.smoothness.plots import plot_scaling
from moga.experiments.smoothness.report import FLAT_TOLERANCE, fmt, held, loglog_slope, table, trend, write_results
from moga.smoothness.block import BlockGeometry
from moga.smoothness.estimates import LOWER_BOUND_NOTE, measure
from moga.train import build_config
from moga.train.build import build_optimizer, model_from_config
from moga.train.tasks import build_task

K_BASE = 2.0
SCALINGS = {"alpha=1": "none", "alpha=K_base/K": "inverse_depth"}
WIDTH_GEOMETRIES = {"row": "row(p=2)", "col": "col(q=2)", "sign": "sign", "spectral": "spectral(method=svd)"}
# what the width paper predicts for each geometry's smoothness: flat, or growth like sqrt(width)
WIDTH_PREDICTION = {"row": "flat", "col": "flat", "sign": "flat", "spectral": "sqrt"}


def _setup(model: dict, data: dict, batch_size: int, lr: float, steps: int, seed: int = 0):
    """(config, task, model, optimizer) built as the training engine builds them."""
    cfg = build_config({"seed": seed, "model": model, "data": data, "optim": {"name": "moga", "lr": lr},
                        "train": {"steps": max(steps, 1), "batch_size": batch_size}})
    task = build_task(cfg)
    torch.manual_seed(seed)
    net = model_from_config(cfg, task.model_inputs)
    return cfg, task, net, build_optimizer(cfg, net)


def probe_batch(task, size: int):
    """The first ``size`` samples (text: sequences) of the training split, unaugmented: the same every call."""
    return next(iter(task.eval_batches("train", size, 1)))


def matrix_block(block: BlockGeometry) -> BlockGeometry:
    """The weight matrices: biases, norm gains and embedding tables are left out (held fixed)."""
    return block.select(lambda e: e.param.dim() >= 2 and e.role != "embedding")


def train_net(net, task, optimizer, steps: int) -> dict:
    """``steps`` optimizer steps on the task's training stream; the mean loss of the last 10 (inf if diverged)."""
    net.train()
    batches = task.train_batches()
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        loss = task.loss(net, x, y)[0]
        if not torch.isfinite(loss):
            losses.append(math.inf)
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    net.eval()
    tail = losses[-10:]
    return {"steps": len(losses), "train_loss": sum(tail) / len(tail) if tail else None,
            "diverged": bool(losses) and not math.isfinite(losses[-1])}


def measure_point(net, task, batch, block: BlockGeometry, starts: int, max_iters: int, tol: float) -> dict:
    """Loss, Lipschitz constant, smoothness lower bound, ``||W||_block`` and the largest norm of each role
    (input, hidden, readout, ...) at the current weights."""
    net.eval()
    start = time.perf_counter()
    norms = block.norms([p.detach() for p in block.params])
    roles: dict[str, float] = {}
    for e, n in zip(block.entries, norms):
        roles[e.role] = max(roles.get(e.role, 0.0), n)
    weight = max(norms)
    if not math.isfinite(weight):
        return {"loss": math.nan, "lipschitz": math.nan, "smoothness": math.nan, "weight_norm": weight,
                "role_norms": roles, "iterations": [], "hvps": 0, "seconds": 0.0}
    m = measure(net, lambda model, b: task.loss(model, *b)[0], batch, block, starts=starts, max_iters=max_iters,
                tol=tol, seed=0)
    return {"loss": m.loss, "lipschitz": m.lipschitz, "smoothness": m.smoothness.value, "weight_norm": weight,
            "role_norms": roles, "iterations": m.smoothness.iterations, "hvps": m.smoothness.hvps,
            "seconds": round(time.perf_counter() - start, 3)}


# --- depth --------------------------------------------------------------------------------------------------


def depth_settings(quick: bool = False, **overrides) -> dict:
    """The depth experiment's defaults (``quick``: the 2-depth miniature the tests run)."""
    s = {"depths": [2, 4, 8, 16, 32, 64], "models": ["residual_mlp", "gpt"], "data": "fashion-mnist",
         "mlp_width": 64, "gpt_width": 32, "gpt_heads": 2, "block_size": 32, "probe": 256, "gpt_probe": 16,
         "batch_size": 128, "gpt_batch_size": 16, "train_steps": 100, "lr": 2**-5, "starts": 2, "max_iters": 20,
         "tol": 1e-3, "full_block": False, "seed": 0}
    if quick:
        s.update(depths=[2, 4], data="digits", mlp_width=16, gpt_width=16, block_size=8, probe=32, gpt_probe=4,
                 batch_size=32, gpt_batch_size=4, train_steps=3, starts=1, max_iters=3)
    unknown = set(overrides) - set(s)
    if unknown:
        raise ValueError(f"unknown depth settings {sorted(unknown)}; valid: {sorted(s)}")
    s.update({k: v for k, v in overrides.items() if v is not None})
    return s


def _depth_model(kind: str, K: int, scaling: str, s: dict) -> tuple[dict, dict, int, int]:
    """(model section, data section, training batch, probe size) of one point."""
    if kind == "residual_mlp":
        model = {"name": "residual_mlp", "width": s["mlp_width"], "depth": K, "activation": "gelu"}
        data, batch, probe = {"name": s["data"]}, s["batch_size"], s["probe"]
    elif kind == "gpt":  # attention="math": the fused kernels have no double backward
        model = {"name": "gpt", "n_layer": K, "n_embd": s["gpt_width"], "n_head": s["gpt_heads"], "attention": "math"}
        data, batch, probe = {"name": "text", "block_size": s["block_size"]}, s["gpt_batch_size"], s["gpt_probe"]
    else:
        raise ValueError(f"unknown model {kind!r}: residual_mlp or gpt")
    model.update(depth_scaling=SCALINGS[scaling], k_base=K_BASE)
    return model, data, batch, probe


def depth_experiment(out: str | Path, quick: bool = False, log: Callable[[str], None] = print, **settings) -> dict:
    """Lipschitz and smoothness against depth, alpha = 1 vs K_base/K; writes depth.png, results.json, summary.md."""
    s = depth_settings(quick, **settings)
    out = Path(out)
    started = time.perf_counter()
    rows = []
    for kind in s["models"]:
        for scaling in SCALINGS:
            for K in s["depths"]:
                model, data, batch, probe = _depth_model(kind, K, scaling, s)
                _, task, net, opt = _setup(model, data, batch, s["lr"], s["train_steps"], s["seed"])
                pbatch = probe_batch(task, probe)
                full = BlockGeometry.from_model(net)
                blocks = {"matrix": matrix_block(full), **({"full": full} if s["full_block"] else {})}
                alpha = K_BASE / K if scaling != "alpha=1" else 1.0
                base = {"model": kind, "scaling": scaling, "alpha": alpha, "K": K}
                for phase in ("init", "trained"):
                    run = {}
                    if phase == "trained":
                        run = train_net(net, task, opt, s["train_steps"])
                    for name, block in blocks.items():
                        point = measure_point(net, task, pbatch, block, s["starts"], s["max_iters"], s["tol"])
                        rows.append({**base, "phase": phase, "block": name, **point, **run})
                        log(f"depth {kind} {scaling} K={K} {phase} {name}: lipschitz {fmt(point['lipschitz'])} "
                            f"smoothness {fmt(point['smoothness'])} ({point['seconds']}s)")
    verdicts = _depth_verdicts(rows, s)
    result = {"experiment": "depth", "settings": s, "tolerance": FLAT_TOLERANCE, "rows": rows,
              "verdicts": verdicts, "seconds": round(time.perf_counter() - started, 1)}
    result["files"] = {"figure": str(plot_scaling(rows, "K", out / "depth.png", "depth K (residual blocks)",
                                                  series="scaling"))}
    return write_results(out, result, _depth_summary(result))


def _depth_verdicts(rows: list[dict], s: dict) -> list[dict]:
    out = []
    for kind in s["models"]:
        for block in ("matrix", "full"):
            for phase in ("init", "trained"):
                for quantity in ("lipschitz", "smoothness"):
                    slopes = {}
                    for scaling in SCALINGS:
                        pts = sorted((r["K"], r[quantity]) for r in rows if r["model"] == kind and r["block"] == block
                                     and r["phase"] == phase and r["scaling"] == scaling)
                        slopes[scaling] = loglog_slope([p[0] for p in pts], [p[1] for p in pts])
                    if all(v is None for v in slopes.values()):
                        continue
                    scaled, unscaled = slopes["alpha=K_base/K"], slopes["alpha=1"]
                    out.append({
                        "model": kind, "block": block, "phase": phase, "quantity": quantity,
                        "slope_scaled": scaled, "slope_unscaled": unscaled,
                        "scaled_flat": None if scaled is None else abs(scaled) <= FLAT_TOLERANCE,
                        "unscaled_grows": None if unscaled is None else unscaled > FLAT_TOLERANCE,
                        "trend_scaled": trend(scaled), "trend_unscaled": trend(unscaled)})
    return out


def _depth_summary(result: dict) -> list[str]:
    s, rows = result["settings"], result["rows"]
    lines = ["# Smoothness and Lipschitz constant vs depth", "",
             f"Depths K = {s['depths']}; alpha = 1 (unscaled) vs alpha = K_base/K with K_base = {K_BASE:g}. "
             f"Residual MLP: width {s['mlp_width']}, GELU, on {s['data']} (probe batch {s['probe']}). "
             f"GPT: n_embd {s['gpt_width']}, {s['gpt_heads']} heads, attention='math', character-level text, "
             f"context {s['block_size']} (probe batch {s['gpt_probe']} sequences). "
             f"'trained': after {s['train_steps']} MOGA steps at lr {s['lr']:g} (batch {s['batch_size']} images, "
             f"{s['gpt_batch_size']} sequences). Geometry: MOGA's default, row(2) on every matrix.",
             "",
             "Block: the weight matrices only (biases, norm gains and embedding tables held fixed)"
             + (", and 'full': every parameter." if s["full_block"] else "."),
             f"Smoothness is {LOWER_BOUND_NOTE} ({s['starts']} starts, at most {s['max_iters']} iterations, "
             f"tolerance {s['tol']:g}); the Lipschitz constant ||grad||_block,* is exact.",
             f"Verdicts: slope of log(value) on log(K); flat is |slope| <= {FLAT_TOLERANCE}, growing is slope > "
             f"{FLAT_TOLERANCE}. Total time {result['seconds']} s.", "", "## Verdicts", ""]
    for v in result["verdicts"]:
        lines.append(f"- {v['model']}, {v['block']} block, {v['phase']}, {v['quantity']}: "
                     f"alpha = K_base/K slope {fmt(v['slope_scaled'])} ({v['trend_scaled']}), flat claim "
                     f"**{held(v['scaled_flat'])}**; alpha = 1 slope {fmt(v['slope_unscaled'])} "
                     f"({v['trend_unscaled']}), growth claim **{held(v['unscaled_grows'])}**.")
    lines += ["", "## Measurements", ""]
    header = ["model", "alpha", "K", "phase", "block", "loss", "lipschitz", "smoothness", "||W||_block", "train loss"]
    lines += table(header, [[r["model"], r["scaling"], r["K"], r["phase"], r["block"], r["loss"], r["lipschitz"],
                             r["smoothness"], r["weight_norm"], r.get("train_loss")] for r in rows])
    lines += ["", "![depth](depth.png)"]
    return lines


# --- width --------------------------------------------------------------------------------------------------


def width_settings(quick: bool = False, **overrides) -> dict:
    s = {"widths": [64, 128, 256, 512, 1024], "geometries": list(WIDTH_GEOMETRIES), "depth": 2,
         "data": "fashion-mnist", "probe": 256, "batch_size": 128, "train_steps": 100, "lr": 2**-5, "starts": 2,
         "max_iters": 12, "tol": 1e-3, "seed": 0}
    if quick:
        s.update(widths=[8, 16], data="digits", probe=32, batch_size=32, train_steps=3, starts=1, max_iters=3)
    unknown = set(overrides) - set(s)
    if unknown:
        raise ValueError(f"unknown width settings {sorted(unknown)}; valid: {sorted(s)}")
    s.update({k: v for k, v in overrides.items() if v is not None})
    bad = [g for g in s["geometries"] if g not in WIDTH_GEOMETRIES]
    if bad:
        raise ValueError(f"unknown geometries {bad}; valid: {', '.join(WIDTH_GEOMETRIES)}")
    return s


def width_experiment(out: str | Path, quick: bool = False, log: Callable[[str], None] = print, **settings) -> dict:
    """Smoothness against width in four geometries; writes width.png, results.json, summary.md."""
    s = width_settings(quick, **settings)
    out = Path(out)
    started = time.perf_counter()
    rows = []
    for width in s["widths"]:
        model = {"name": "residual_mlp", "width": width, "depth": s["depth"], "activation": "gelu"}
        _, task, net, opt = _setup(model, {"name": s["data"]}, s["batch_size"], s["lr"], s["train_steps"], s["seed"])
        pbatch = probe_batch(task, s["probe"])
        for phase in ("init", "trained"):
            run = train_net(net, task, opt, s["train_steps"]) if phase == "trained" else {}
            for name in s["geometries"]:
                spec = WIDTH_GEOMETRIES[name]
                block = matrix_block(BlockGeometry.from_model(net, {r: spec for r in ("input", "hidden", "readout")}))
                point = measure_point(net, task, pbatch, block, s["starts"], s["max_iters"], s["tol"])
                rows.append({"width": width, "geometry": name, "spec": spec, "phase": phase, "block": "matrix",
                             **point, **run})
                log(f"width {width} {name} {phase}: lipschitz {fmt(point['lipschitz'])} "
                    f"smoothness {fmt(point['smoothness'])} ({point['seconds']}s)")
    verdicts = _width_verdicts(rows, s)
    result = {"experiment": "width", "settings": s, "tolerance": FLAT_TOLERANCE, "rows": rows, "verdicts": verdicts,
              "seconds": round(time.perf_counter() - started, 1)}
    result["files"] = {"figure": str(plot_scaling(rows, "width", out / "width.png", "width", series="geometry"))}
    return write_results(out, result, _width_summary(result))


def _width_verdicts(rows: list[dict], s: dict) -> list[dict]:
    out = []
    for name in s["geometries"]:
        for phase in ("init", "trained"):
            for quantity in ("lipschitz", "smoothness"):
                pts = sorted((r["width"], r[quantity]) for r in rows if r["geometry"] == name and r["phase"] == phase)
                slope = loglog_slope([p[0] for p in pts], [p[1] for p in pts])
                # The paper: Lipschitz flat in every mean geometry; smoothness flat except spectral (up to sqrt).
                predicted = WIDTH_PREDICTION[name] if quantity == "smoothness" else "flat"
                if slope is None:
                    ok = None
                elif predicted == "flat":
                    ok = abs(slope) <= FLAT_TOLERANCE
                else:  # "possibly growing like sqrt(width)": a bound, so any slope up to 0.5 (+ tol) agrees
                    ok = slope <= 0.5 + FLAT_TOLERANCE
                out.append({"geometry": name, "phase": phase, "quantity": quantity, "slope": slope,
                            "trend": trend(slope), "predicted": predicted, "held": ok,
                            "sqrt_like": None if slope is None else abs(slope - 0.5) <= FLAT_TOLERANCE})
    return out


def _width_summary(result: dict) -> list[str]:
    s, rows = result["settings"], result["rows"]
    lines = ["# Smoothness vs width", "",
             f"Residual MLP with {s['depth']} blocks (GELU, alpha = 1) on {s['data']} at widths {s['widths']}; "
             f"probe batch {s['probe']}. 'trained': after {s['train_steps']} MOGA steps (lr {s['lr']:g}, batch "
             f"{s['batch_size']}); every geometry is measured at the same weights.",
             "Block: the weight matrices (input, hidden, readout), all in the named geometry: "
             + ", ".join(f"{k} = {v}" for k, v in WIDTH_GEOMETRIES.items() if k in s["geometries"]) + ".",
             f"Smoothness is {LOWER_BOUND_NOTE} ({s['starts']} starts, at most {s['max_iters']} iterations).",
             f"Verdicts: slope of log(value) on log(width), flat is |slope| <= {FLAT_TOLERANCE}. Predicted: row, col "
             "and sign smoothness flat, spectral smoothness at most ~sqrt(width) (a worst case: a slope up to "
             f"0.5 + {FLAT_TOLERANCE} agrees, and 'sqrt-like' says whether it is near 0.5); Lipschitz flat in all. "
             f"Total time {result['seconds']} s.", "",
             "The theory bounds the constants uniformly over a ball ||W||_block <= C. PyTorch's default init "
             "(entries U(-1/sqrt(n), 1/sqrt(n)) for fan-in n) is in a fixed ball only for spectral: a hidden "
             "width x width matrix has spectral norm ~1.15 at every width, but row(2) and col(2) norms "
             "~ sqrt(width/3) and sign norm sqrt(width). So in row, col and sign the 'init' points move outwards "
             "as width grows; the hidden matrices' norm is listed beside each value ('hidden ||W||'). The paper "
             "puts (p,mean)->inf on the readout; here one geometry covers every matrix, readout included.",
             "", "## Verdicts", ""]
    for v in result["verdicts"]:
        extra = f", sqrt-like: {'yes' if v['sqrt_like'] else 'no'}" if v["predicted"] == "sqrt" else ""
        lines.append(f"- {v['geometry']}, {v['phase']}, {v['quantity']}: slope {fmt(v['slope'])} ({v['trend']}); "
                     f"predicted {v['predicted']}: **{held(v['held'])}**{extra}.")
    lines += ["", "## Measurements", ""]
    lines += table(["width", "geometry", "phase", "loss", "lipschitz", "smoothness", "||W||_block", "hidden ||W||",
                    "iterations"],
                   [[r["width"], r["geometry"], r["phase"], r["loss"], r["lipschitz"], r["smoothness"],
                     r["weight_norm"], r["role_norms"].get("hidden"), ",".join(map(str, r["iterations"]))]
                    for r in rows])
    lines += ["", "![width](width.png)"]
    return lines
