"""Experiment 3 of ``moga smoothness`` (the convergence paper) and the depth paper's step rule against constant rates.

Both train with the engine (:func:`moga.train.run`), one run directory per run under ``OUT/runs``, so a second
call reuses finished runs. Budgets are CPU-sized: the paper trains 100 epochs (shared-weights nets) and 1000
(the long ``L = 2`` run); the defaults here are a few epochs, stated in every summary.

Convergence paper (docs/math.md §6):

- adaptive vs constant learning rate: bias-free GELU feedforward nets, width 512, ``L = 4`` layers, batch 512,
  cross-entropy, plain gradient descent; the constant rates span the lr-range test's fastest-descent range
  ``[steepest, lr at the minimum]`` (the paper's recipe); on Fashion-MNIST, and CIFAR-10 flattened when present.
  Claim: the adaptive step converges faster (lower final training loss than every constant rate).
- the shared-weights net over depths ``L``: adaptive and one constant rate per depth (the lr at the minimum of
  that depth's range test, the best of its short runs, or the next grid rate down when it diverges). Claim:
  deeper converges slower (final training loss rises with ``L`` over ``L >= 3``); ``L = 2`` is the paper's
  exception.
- ``L = 2`` on a longer run: claim, ``||W_t||`` grows without bound. A finite run can only show whether it is
  still rising at the end.

All three run on seeds ``seed, seed + 1, ...`` (``seeds`` of them) at the rates picked once, from the range
tests of the first seed, so the seeds pair up (a shared-weights depth whose rate diverges on a later seed steps
down the same grid there). :mod:`.checks` decides each claim from the per-seed numbers, which
``results.json`` keeps under ``seed_numbers``: a paired Student t interval, a seed-bootstrap interval on the
Spearman correlation, a Student t interval on the growth of ``||W||``.

Step rule (depth paper, ``eta* = ||grad||_* / L``): a residual MLP with MOGA at a grid of constant rates, against
``optim.step_rule = depth_paper`` with a running L (max and EMA of the trajectory smoothness) and with L
measured once at initialization.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from moga.data.images import locate_image_data
from moga.experiments.smoothness.checks import (depth_order, depth_text, gain_text, growth_check, growth_text,
                                                paired_gain, stored_loss)
from moga.experiments.smoothness.plots import plot_curves
from moga.experiments.smoothness.report import fmt, table, write_results
from moga.smoothness import BlockGeometry, smoothness
from moga.status import Status
import moga.train as training  # its engine loads when a run starts, not when a listing reads the settings
from moga.train import build_config, read_metrics
from moga.train.build import build_optimizer, model_from_config
from moga.train.tasks import build_task

LOSS_CEILING = 50.0  # cross-entropy starts near log(10) = 2.3: a loss of 50 is a diverged run


def _available(data: str) -> bool:
    """Whether the data set's files are here (Fashion-MNIST and CIFAR-10 are optional installs)."""
    try:
        if data in ("fashion-mnist", "cifar10"):
            locate_image_data(data)
    except FileNotFoundError:
        return False
    return True


def _config(name: str, model: dict, data: str, optim: dict, epochs: float, batch_size: int, s: dict,
            **logging) -> dict:
    return {"seed": s["seed"], "name": name, "model": model, "data": {"name": data, "augment": False},
            "optim": optim, "train": {"epochs": epochs, "batch_size": batch_size, "loss_ceiling": LOSS_CEILING},
            "eval": {"every": 0, "train_eval": False}, "checkpoint": {"every": 0, "save_final": False},
            "logging": {"log_every": s["log_every"], "progress": False, **logging}}


def _run(cfg: dict, out: Path, log) -> dict:
    """Train (or read back) one run; its result with the training curve of metrics.jsonl."""
    run_dir = out / "runs" / f"{cfg['name']}-{build_config(cfg).hash()[:8]}"  # other settings, other directory
    start = time.perf_counter()
    result = training.run(cfg, run_dir, quiet=True)
    train = read_metrics(run_dir / "metrics.jsonl", "train")
    diag = read_metrics(run_dir / "metrics.jsonl", "diagnostics")
    log(f"{cfg['name']}: {result['status']}, final train loss {fmt(result['final_train_loss'])} "
        f"({time.perf_counter() - start:.1f}s)")
    return {"name": cfg["name"], "status": result["status"], "final_train_loss": result["final_train_loss"],
            "val_acc": result.get("val_acc"), "steps": result["steps"], "wall_time_s": result["wall_time_s"],
            "optim": cfg["optim"], "curve": {"step": [r["step"] for r in train], "loss": [r["loss"] for r in train],
                                             "lr": [r["lr"] for r in train]},
            "eta": [r.get("eta") for r in train], "w_norm": [r.get("w_norm") for r in train],
            "smoothness_L": [r.get("smoothness_L") for r in train],
            "weights": {"step": [r["step"] for r in diag], "frobenius": [r["weight_frobenius"] for r in diag]}}


def _range(cfg: dict, out: Path, s: dict, log) -> dict:
    """The lr range test of plain gradient descent on this model and data, as the paper ran it (appendix D):
    every rate trains the same initial model for ``range_steps`` steps (restart mode). A single sweep is
    misled by the long plateau of the deeper shared-weights nets: its steepest point lands near divergence."""
    r = training.lr_range_test({**cfg, "optim": {"name": "sgd"}}, out / "lr_range" / cfg["name"],
                               lr_min=s["range_lr_min"], lr_max=s["range_lr_max"], mode="restart",
                               num_lrs=s["range_lrs"], steps_per_lr=s["range_steps"])
    log(f"lr range {cfg['name']}: steepest {fmt(r['suggestion']['steepest'])}, "
        f"at min {fmt(r['suggestion']['lr_at_min'])}")
    return r


def constant_rates(suggestion: dict, n: int) -> list[float]:
    """``n`` rates over the range where the loss falls fastest, ``[steepest, lr at the minimum]`` (geometric),
    or around the steepest point (x1/2 .. x2) when that range is empty. One rate is the lr at the minimum: in
    restart mode, the best constant rate of the test's short runs."""
    lo, hi = suggestion.get("steepest"), suggestion.get("lr_at_min")
    if lo is None:
        raise ValueError("the lr range test found no descending range (too few finite losses)")
    if n == 1:
        return [float(hi if hi is not None else lo)]
    if hi is None or hi <= lo * 1.01:
        lo, hi = lo / 2, lo * 2
    return [float(x) for x in np.geomspace(lo, hi, n)]


def fallback_rates(range_test: dict, tries: int = 3) -> list[float]:
    """The range test's grid rates from the lr at its minimum downwards: the first that does not diverge over the
    whole run is the shared-weights net's constant rate. The deep nets sit on a long plateau, so a short test
    can rank a rate best that diverges later."""
    top = range_test["suggestion"].get("lr_at_min")
    if top is None:
        raise ValueError("the lr range test found no finite loss")
    return sorted((lr for lr in range_test["lrs"] if lr <= top * (1 + 1e-9)), reverse=True)[:tries]


def convergence_settings(quick: bool = False, **overrides) -> dict:
    s = {"data": ["fashion-mnist", "cifar10"], "width": 512, "depth": 4, "batch_size": 512, "epochs": 3,
         "cifar_epochs": 2, "constant_rates": 3, "shared_depths": [2, 3, 4, 6, 8], "shared_epochs": 3,
         "long_epochs": 20, "alpha": 1.0, "range_steps": 40, "range_lrs": 9, "range_lr_min": 1e-3,
         "range_lr_max": 10.0, "log_every": 5, "seed": 0, "seeds": 1}
    if quick:
        s.update(data=["digits"], width=32, depth=3, batch_size=64, epochs=1, cifar_epochs=1, constant_rates=2,
                 shared_depths=[2, 3], shared_epochs=1, long_epochs=2, range_steps=4, range_lrs=5, log_every=2)
    unknown = set(overrides) - set(s)
    if unknown:
        raise ValueError(f"unknown convergence settings {sorted(unknown)}; valid: {sorted(s)}")
    s.update({k: v for k, v in overrides.items() if v is not None})
    if int(s["seeds"]) < 1:
        raise ValueError(f"convergence setting seeds must be at least 1, got {s['seeds']}")
    return s


def _seeded(cfg: dict, seed: int) -> dict:
    """The run of ``cfg`` on another seed: the seed is part of the config, so of its cache key (the first seed
    keeps its name and config, so its cached runs stay valid)."""
    return cfg if seed == cfg["seed"] else {**cfg, "seed": seed, "name": f"{cfg['name']}-seed{seed}"}


def convergence_experiment(out: str | Path, quick: bool = False, log: Callable[[str], None] = print,
                           **settings) -> dict:
    """Adaptive vs constant rates, the shared-weights net over depths, and ||W_t|| at L = 2 on a longer run."""
    s = convergence_settings(quick, **settings)
    out = Path(out)
    started = time.perf_counter()
    result: dict = {"experiment": "convergence", "settings": s, "missing": [], "adaptive_vs_constant": [],
                    "shared": {}, "long": {}}
    seeds = list(range(s["seed"], s["seed"] + int(s["seeds"])))
    numbers: dict = {"adaptive_vs_constant": [], "deeper_slower": {}, "w_growth": {}}  # what .checks decides on
    result["seed_numbers"] = numbers
    panels = []
    # 1. adaptive vs constant on feedforward nets
    for data in s["data"]:
        if not _available(data):
            result["missing"].append(data)
            log(f"{data}: not present, skipped")
            continue
        entry, seed_numbers, panel = _adaptive_vs_constant(data, out, s, seeds, log)
        result["adaptive_vs_constant"].append(entry)
        numbers["adaptive_vs_constant"].append(seed_numbers)
        panels.append(panel)
    # 2. the shared-weights net over depths, and 3. L = 2 on a longer run
    data = next((d for d in s["data"] if _available(d)), None)
    if data is not None and s["shared_depths"]:
        rates = {L: fallback_rates(_range(_shared_base(L, data, s), out, s, log)) for L in s["shared_depths"]}
        per_seed = []
        for seed in seeds:
            per_seed.append(_shared_runs(out, s, data, seed, rates, per_seed[0] if per_seed else None, log))
        result["shared"] = _shared_verdicts(per_seed, s, data, numbers)
        for kind in ("adaptive", "constant"):
            panels.append({"title": f"shared weights, {kind} lr, {data}, seed {seeds[0]}", "ylabel": "training loss",
                           "logy": True, "curves": [_curve(r, f"L={r['L']}") for r in per_seed[0][kind]]})
        if 2 in s["shared_depths"]:
            result["long"] = long = _long_runs(out, s, data, seeds, per_seed, numbers, log)
            panels.append({"title": f"shared weights L=2, {s['long_epochs']} epochs: ||W_t||, seed {seeds[0]}",
                           "ylabel": "||W_t|| (Frobenius)", "logy": False,
                           "curves": [{"label": k, "x": long[k]["weights"]["step"],
                                       "y": long[k]["weights"]["frobenius"]} for k in ("adaptive", "constant")]})
            panels.append({"title": f"shared weights L=2, {s['long_epochs']} epochs: loss, seed {seeds[0]}",
                           "ylabel": "training loss", "logy": True,
                           "curves": [_curve(long[k], k) for k in ("adaptive", "constant")]})
    result["seconds"] = round(time.perf_counter() - started, 1)
    if panels:
        result["files"] = {"figure": str(plot_curves(panels, out / "convergence.png"))}
    return write_results(out, result, _convergence_summary(result))


def _adaptive_vs_constant(data: str, out: Path, s: dict, seeds: list[int], log) -> tuple[dict, dict, dict]:
    """The feedforward net on ``data``, adaptive against the constant rates of its range test, on every seed:
    (the result's entry, the per-seed numbers .checks decides on, the figure's panel)."""
    epochs = s["cifar_epochs"] if data.startswith("cifar") else s["epochs"]
    model = {"name": "feedforward", "width": s["width"], "depth": s["depth"], "activation": "gelu"}
    base = _config(f"ff-{data}", model, data, {}, epochs, s["batch_size"], s)
    rates = constant_rates(_range(base, out, s, log)["suggestion"], s["constant_rates"])
    per_seed = []  # [adaptive, constant at each rate] per seed, the same rates on every seed
    for seed in seeds:
        per_seed.append([_run(_seeded({**base, "name": f"ff-{data}-adaptive",
                                       "optim": {"name": "adaptive-gd", "lr": s["alpha"]}}, seed), out, log)]
                        + [_run(_seeded({**base, "name": f"ff-{data}-constant-{lr:.3g}",
                                         "optim": {"name": "sgd", "lr": lr}}, seed), out, log) for lr in rates])
    adaptive_losses = [_loss(rs[0]) for rs in per_seed]
    constant_losses = {lr: [_loss(rs[1 + i]) for rs in per_seed] for i, lr in enumerate(rates)}
    gain = paired_gain(adaptive_losses, constant_losses)
    runs = per_seed[0]
    adaptive = runs[0]
    entry = {
        "data": data, "epochs": epochs, "constant_rates": rates, "runs": [r for rs in per_seed for r in rs],
        "adaptive_final_loss": float(np.mean(adaptive_losses)),
        "best_constant_lr": gain["best_constant_lr"],
        "best_constant_final_loss": float(np.mean(constant_losses[gain["best_constant_lr"]])),
        "held": gain["difference"] > 0, "gain": gain, "verdict": gain["verdict"]}
    seed_numbers = {
        "data": data, "seeds": seeds, "adaptive": adaptive_losses,
        "constant": [{"lr": lr, "losses": v} for lr, v in constant_losses.items()]}
    panel = {"title": f"feedforward L={s['depth']}, width {s['width']}, {data}", "ylabel": "training loss",
             "logy": True, "curves": [_curve(r, "adaptive" if r is adaptive else f"lr {r['optim']['lr']:.3g}")
                                      for r in runs]}
    return entry, seed_numbers, panel


def _loss(run: dict) -> float:
    return stored_loss(run["final_train_loss"])


def _finite_ratio(a: float | None, b: float | None) -> float:
    a, b = (math.inf if x is None else x for x in (a, b))
    return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def _curve(run: dict, label: str) -> dict:
    return {"label": label, "x": run["curve"]["step"], "y": run["curve"]["loss"]}


def _shared_base(L: int, data: str, s: dict) -> dict:
    model = {"name": "shared_weights", "width": s["width"], "depth": L, "activation": "gelu"}
    return _config(f"shared-L{L}-{data}", model, data, {}, s["shared_epochs"], s["batch_size"], s)


def _shared_runs(out: Path, s: dict, data: str, seed: int, rates: dict, first: dict | None, log) -> dict:
    """The shared-weights net at every depth on one seed: adaptive, and the first of the depth's fallback rates
    that does not diverge; on a later seed, starting at the rate the first seed settled on."""
    shared = {"adaptive": [], "constant": []}
    for L in s["shared_depths"]:
        base = _shared_base(L, data, s)
        a = _run(_seeded({**base, "name": f"shared-L{L}-{data}-adaptive",
                          "optim": {"name": "adaptive-gd", "lr": s["alpha"]}}, seed), out, log)
        candidates = rates[L]
        if first is not None:
            top = next(r for r in first["constant"] if r["L"] == L)["optim"]["lr"]
            candidates = [lr for lr in candidates if lr <= top * (1 + 1e-9)]
        tried = []
        for lr in candidates:
            c = _run(_seeded({**base, "name": f"shared-L{L}-{data}-constant-{lr:.3g}",
                              "optim": {"name": "sgd", "lr": lr}}, seed), out, log)
            tried.append({"lr": lr, "status": c["status"], "steps": c["steps"]})
            if c["status"] != Status.DIVERGED:
                break
        c["tried"] = tried
        shared["adaptive"].append({"L": L, "seed": seed, **a})
        shared["constant"].append({"L": L, "seed": seed, **c})
    return shared


def _shared_verdicts(per_seed: list[dict], s: dict, data: str, numbers: dict) -> dict:
    first = per_seed[0]
    out = {"data": data, "epochs": s["shared_epochs"], "deeper_slower": {}, "l2_plateau": {},
           "runs": {k: [r for sh in per_seed for r in sh[k]] for k in first}}
    for kind, runs in first.items():
        depths = [r["L"] for r in runs]
        numbers["deeper_slower"][kind] = {"depths": depths, "seeds": [sh[kind][0]["seed"] for sh in per_seed],
                                          "losses": [[_loss(r) for r in sh[kind]] for sh in per_seed]}
        out["deeper_slower"][kind] = {**depth_order(depths, numbers["deeper_slower"][kind]["losses"]),
                                      "final_losses": {r["L"]: r["final_train_loss"] for r in runs}}
        deep = [r for r in runs if r["L"] >= 3]
        two = next((r for r in runs if r["L"] == 2), None)
        if two is not None and deep:
            out["l2_plateau"][kind] = _loss(two) > max(_loss(r) for r in deep)
    # adaptive GD logs ||W_t|| every record: its growth over each run's second half, for the long run's context
    out["w_growth_second_half"] = {}
    for r in first["adaptive"]:
        w = [x for x in r["w_norm"] if x is not None and math.isfinite(x)]
        out["w_growth_second_half"][r["L"]] = w[-1] / w[len(w) // 2] - 1 if len(w) >= 2 else None
    return out


GROWTH_KEYS = ("w_first", "w_mid", "w_end", "growth_second_half", "rose_last_quarter")


def _long_runs(out: Path, s: dict, data: str, seeds: list[int], per_seed: list[dict], numbers: dict, log) -> dict:
    """The long L = 2 runs on every seed: the first seed's runs whole (for the figures), the later seeds' growth
    of ||W|| under ``seeds``, and each lr kind's check over the seeds."""
    runs = [_long_run(out, s, data, shared, seed, log) for seed, shared in zip(seeds, per_seed)]
    long = {}
    for kind in ("adaptive", "constant"):
        later = [{k: r[kind][k] for k in ("name", "status", "steps", "final_train_loss", "val_acc", "optim",
                                          *GROWTH_KEYS) if k in r[kind]} for r in runs[1:]]
        numbers["w_growth"][kind] = d = {"seeds": seeds, "growth": [r[kind].get("growth_second_half") for r in runs],
                                         "rose_last_quarter": [r[kind].get("rose_last_quarter") for r in runs]}
        long[kind] = {**runs[0][kind], "seeds": later, "check": growth_check(d["growth"], d["rose_last_quarter"])}
    return long


def _long_run(out: Path, s: dict, data: str, shared: dict, seed: int, log) -> dict:
    """L = 2 for ``long_epochs``, adaptive and constant, with ||W_t|| from diagnostics records."""
    model = {"name": "shared_weights", "width": s["width"], "depth": 2, "activation": "gelu"}
    const_lr = next(r for r in shared["constant"] if r["L"] == 2)["optim"]["lr"]
    res = {}
    for kind, optim in (("adaptive", {"name": "adaptive-gd", "lr": s["alpha"]}),
                        ("constant", {"name": "sgd", "lr": const_lr})):
        name = f"shared-L2-{data}-long-{kind}"
        cfg = _config(name, model, data, optim, s["long_epochs"], s["batch_size"], s,
                      diagnostics_every=max(1, s["log_every"] * 4))
        r = _run(_seeded(cfg, seed), out, log)
        w = [x for x in r["weights"]["frobenius"] if x is not None and math.isfinite(x)]
        n = len(w)
        if n >= 4:
            mid, three_q, end = w[n // 2], w[(3 * n) // 4], w[-1]
            r.update(w_first=w[0], w_mid=mid, w_end=end, growth_second_half=end / mid - 1,
                     rose_last_quarter=end > three_q)
        res[kind] = r
    return res


def _convergence_summary(result: dict) -> list[str]:
    s = result["settings"]
    lines = ["# The convergence paper at CPU scale", "",
             f"Plain (minibatch) gradient descent, batch {s['batch_size']}, cross-entropy, GELU, no biases. Adaptive "
             f"step with alpha = {s['alpha']:g}. Constant rates from the lr range test as in the paper's appendix "
             f"D ({s['range_lrs']} rates from {s['range_lr_min']:g} to {s['range_lr_max']:g}, each training the "
             f"initial model for {s['range_steps']} steps): feedforward, {s['constant_rates']} rates over the "
             "fastest-descent range [steepest, lr at the minimum]; shared weights, the lr at the minimum (or the next "
             "grid rate down, up to twice, when a run at it diverges). Budgets: "
             f"feedforward {s['epochs']} epochs (CIFAR-10: {s['cifar_epochs']}), shared-weights {s['shared_epochs']} "
             f"epochs per depth, the long L = 2 run {s['long_epochs']} epochs (the paper: 100 and 1000). "
             "'final loss' is the mean training loss over the last epoch of steps. "
             f"Every run on {s['seeds']} seed(s) from {s['seed']}, at the rates picked on the first; losses are "
             "seed means, figures show the first seed.",
             f"Total time {result['seconds']} s." + (f" Not present, skipped: {', '.join(result['missing'])}."
                                                      if result["missing"] else ""), "", "## Verdicts", ""]
    for a in result["adaptive_vs_constant"]:
        lines.append(f"- Adaptive faster than constant ({a['data']}, feedforward L={s['depth']}, width {s['width']}, "
                     f"{a['epochs']} epochs): adaptive final loss {fmt(a['adaptive_final_loss'])}, best constant "
                     f"(lr {fmt(a['best_constant_lr'])}) {fmt(a['best_constant_final_loss'])} "
                     f"({100 * (_finite_ratio(a['adaptive_final_loss'], a['best_constant_final_loss']) - 1):+.1f}%); "
                     f"{gain_text(a['gain'])}: **{a['verdict']}**.")
    sh = result.get("shared") or {}
    for kind, v in (sh.get("deeper_slower") or {}).items():
        numbers = result["seed_numbers"]["deeper_slower"][kind]
        means = np.mean(numbers["losses"], axis=0)
        losses = ", ".join(f"L={L}: {fmt(float(x))}" for L, x in zip(numbers["depths"], means))
        lines.append(f"- Deeper converges slower (shared weights, {kind} lr, L >= 3, {sh['epochs']} epochs on "
                     f"{sh['data']}): {depth_text(v)}: **{v['verdict']}** (seed-mean final losses {losses}).")
    for kind, v in (sh.get("l2_plateau") or {}).items():
        lines.append(f"- L = 2 ends above every deeper net ({kind} lr; the paper's exception): "
                     f"{'yes' if v else 'no'}.")
    if sh.get("w_growth_second_half"):
        growth = ", ".join(f"L={k}: {'-' if g is None else f'{100 * g:+.1f}%'}"
                           for k, g in sh["w_growth_second_half"].items())
        lines.append(f"- ||W_t|| over the second half of the {sh['epochs']}-epoch adaptive runs: {growth}.")
    for kind, r in (result.get("long") or {}).items():
        first = (f"; seed {s['seed']}: ||W|| {fmt(r['w_first'])} -> {fmt(r['w_mid'])} (mid) -> {fmt(r['w_end'])} "
                 "(end)") if "w_end" in r else ""
        lines.append(f"- ||W_t|| still rising at the end at L = 2 ({kind} lr, {s['long_epochs']} epochs): "
                     f"{growth_text(r['check'])}: **{r['check']['verdict']}**{first} (a finite run cannot show "
                     "'without bound').")
    lines += ["", "## Runs", ""]
    rows = []
    for a in result["adaptive_vs_constant"]:
        rows += [[f"ff {a['data']}", r["name"], r["optim"].get("lr"), r["status"], r["steps"], r["final_train_loss"],
                  r["val_acc"]] for r in a["runs"]]
    for kind, runs in (sh.get("runs") or {}).items():
        rows += [[f"shared L={r['L']}", r["name"], r["optim"].get("lr"), r["status"], r["steps"],
                  r["final_train_loss"], r["val_acc"]] for r in runs]
    for kind, r in (result.get("long") or {}).items():
        rows += [["shared L=2 long", x["name"], x["optim"].get("lr"), x["status"], x["steps"],
                  x["final_train_loss"], x["val_acc"]] for x in [r, *r["seeds"]]]
    lines += table(["task", "run", "lr / alpha", "status", "steps", "final loss", "val acc"], rows)
    lines += ["", "![convergence](convergence.png)"]
    return lines


# --- the depth paper's step rule against constant rates ------------------------------------------------------


def step_rule_settings(quick: bool = False, **overrides) -> dict:
    s = {"data": "fashion-mnist", "width": 128, "depth": 4, "batch_size": 128, "epochs": 2,
         "lrs": [2.0**-k for k in (8, 7, 6, 5, 4, 3, 2)], "cap": 1.0, "smoothness_every": 10, "starts": 2,
         "max_iters": 20, "log_every": 10, "seed": 0}
    if quick:
        s.update(data="digits", width=16, depth=2, batch_size=32, lrs=[2.0**-5, 2.0**-3], smoothness_every=5,
                 starts=1, max_iters=3, log_every=4)
    unknown = set(overrides) - set(s)
    if unknown:
        raise ValueError(f"unknown step-rule settings {sorted(unknown)}; valid: {sorted(s)}")
    s.update({k: v for k, v in overrides.items() if v is not None})
    return s


def _measured_smoothness(cfg: dict, s: dict) -> float:
    """L at initialization in the optimizer's block, on the engine's probe batch (a lower bound, HVP ascent)."""
    c = build_config(cfg)
    task = build_task(c)
    torch.manual_seed(c.seed)  # the engine's initial weights
    net = model_from_config(c, task.model_inputs)
    block = BlockGeometry.from_optimizer(build_optimizer(c, net))
    net.eval()
    batch = next(iter(task.eval_batches("train", task.micro_batch, 1)))
    return smoothness(net, lambda m, b: task.loss(m, *b)[0], batch, block, starts=s["starts"],
                      max_iters=s["max_iters"]).value


def step_rule_experiment(out: str | Path, quick: bool = False, log: Callable[[str], None] = print,
                         **settings) -> dict:
    """MOGA on a residual MLP: a constant-lr grid against lr_t = min(cap, ||grad||_* / L_t)."""
    s = step_rule_settings(quick, **settings)
    out = Path(out)
    started = time.perf_counter()
    model = {"name": "residual_mlp", "width": s["width"], "depth": s["depth"], "activation": "gelu"}
    base = _config("steprule", model, s["data"], {}, s["epochs"], s["batch_size"], s)
    constants = [_run({**base, "name": f"constant-{lr:.4g}", "optim": {"name": "moga", "lr": lr}}, out, log)
                 for lr in s["lrs"]]
    rule = {"name": "moga", "lr": s["cap"], "step_rule": "depth_paper"}
    running = {kind: _run({**base, "name": f"depth-paper-running-{kind}",
                           "optim": {**rule, "smoothness": kind, "smoothness_every": s["smoothness_every"]}}, out, log)
               for kind in ("max", "ema")}
    L0 = _measured_smoothness({**base, "optim": {"name": "moga", "lr": s["cap"]}}, s)
    log(f"measured smoothness at init: {fmt(L0)}")
    measured = _run({**base, "name": "depth-paper-measured", "optim": {**rule, "smoothness": L0}}, out, log)
    best = min(constants, key=_loss)
    rule_runs = {"running L (max)": running["max"], "running L (ema)": running["ema"], "measured L": measured}
    rows = []
    for label, r in rule_runs.items():
        lrs = [x for x in r["curve"]["lr"] if x is not None]
        rows.append({"rule": label, "final_train_loss": r["final_train_loss"], "val_acc": r["val_acc"],
                     "lr_min": min(lrs), "lr_median": float(np.median(lrs)), "lr_max": max(lrs),
                     "relative_to_best": _loss(r) / _loss(best) - 1, "better": _loss(r) < _loss(best),
                     "beats_constants": sum(_loss(r) < _loss(c) for c in constants)})
    result = {"experiment": "steprule", "settings": s, "measured_L": L0, "constants": constants,
              "rule_runs": rule_runs, "best_constant_lr": best["optim"]["lr"],
              "best_constant_final_loss": best["final_train_loss"], "best_constant_val_acc": best["val_acc"],
              "comparison": rows, "seconds": round(time.perf_counter() - started, 1)}
    panels = [{"title": "training loss", "ylabel": "loss", "logy": True,
               "curves": [_curve(r, f"lr {r['optim']['lr']:.3g}") for r in constants]
               + [_curve(r, f"eta*, {label}") | {"color": "k", "style": style}
                  for (label, r), style in zip(rule_runs.items(), ("-", ":", "--"))]},
              {"title": "learning rate of the rule", "ylabel": "lr", "logy": True,
               "curves": [{"label": label, "x": r["curve"]["step"], "y": r["curve"]["lr"], "color": "k",
                           "style": style} for (label, r), style in zip(rule_runs.items(), ("-", ":", "--"))]
               + [{"label": f"best constant {best['optim']['lr']:.3g}", "x": best["curve"]["step"],
                   "y": best["curve"]["lr"], "color": "C3", "style": "-."}]},
              {"title": "running L of the rule", "ylabel": "L", "logy": True,
               "curves": [{"label": label, "x": r["curve"]["step"], "y": r["smoothness_L"], "color": "k",
                           "style": style} for (label, r), style in zip(rule_runs.items(), ("-", ":", "--"))]}]
    result["files"] = {"figure": str(plot_curves(panels, out / "steprule.png"))}
    return write_results(out, result, _step_rule_summary(result))


def _step_rule_summary(result: dict) -> list[str]:
    s = result["settings"]
    lines = ["# The depth paper's step rule vs the best constant rate", "",
             f"MOGA (momentum 0.9, Adam on vectors) on a residual MLP (width {s['width']}, {s['depth']} blocks, GELU) "
             f"on {s['data']}, batch {s['batch_size']}, {s['epochs']} epoch(s), constant schedule. Constant rates "
             f"{', '.join(f'{x:.4g}' for x in s['lrs'])}. The rule: optim.step_rule=depth_paper, "
             f"lr_t = min({s['cap']:g}, "
             f"||grad_t||_block,* / L_t) (every parameter in the block, as the optimizer steps them), with L_t the "
             f"running max or EMA of the trajectory smoothness measured every {s['smoothness_every']} steps on a "
             f"probe batch, or L measured once at initialization by HVP ascent (L = {fmt(result['measured_L'])}, a "
             f"lower bound). 'final loss': mean training loss over the last epoch of steps. "
             f"Total time {result['seconds']} s.", "", "## Verdict", ""]
    best = result["best_constant_final_loss"]
    lines.append(f"Best constant rate: lr {fmt(result['best_constant_lr'])}, final loss {fmt(best)}, val acc "
                 f"{fmt(result['best_constant_val_acc'])}.")
    for r in result["comparison"]:
        word = "better" if r["better"] else "worse"
        lines.append(f"- eta* = ||grad||_*/L with {r['rule']}: final loss {fmt(r['final_train_loss'])} "
                     f"({100 * r['relative_to_best']:+.1f}% vs the best constant: **{word}**), val acc "
                     f"{fmt(r['val_acc'])}; better than {r['beats_constants']} of the {len(result['constants'])} "
                     f"constant rates; its lr ranged {fmt(r['lr_min'])} .. {fmt(r['lr_max'])} "
                     f"(median {fmt(r['lr_median'])}).")
    lines += ["", "## Runs", ""]
    runs = result["constants"] + list(result["rule_runs"].values())
    lines += table(["run", "status", "steps", "final loss", "val acc"],
                   [[r["name"], r["status"], r["steps"], r["final_train_loss"], r["val_acc"]] for r in runs])
    lines += ["", "![step rule](steprule.png)"]
    return lines
