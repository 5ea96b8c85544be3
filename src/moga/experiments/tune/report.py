"""What ``moga tune`` prints and stores: the short summary, ``tune.md``, and ready-to-run snippets."""

from __future__ import annotations

import math
from pathlib import Path

from moga.sweep.report.decision import bracketed

OPTIMIZER_CLASSES = {"moga": "MOGA", "muon": "Muon", "adamw-scaled": "ScaledAdamW"}
PLAIN_KEYS = ("p", "preset", "momentum", "nesterov", "weight_decay")


def _pct_2dp(v) -> str:
    return "n/a" if v is None else "diverges" if math.isinf(v) else f"{100 * v:.2f}%"


def snippets(cfg: dict, path: Path) -> dict:
    """A ``moga train`` command for the target's config file, a ``torchrun`` one, HF Trainer and plain PyTorch."""
    optim, model = cfg["optim"], cfg["model"]
    lr = optim["lr"]
    name = optim.get("name", "moga")
    kwargs = "".join(f", {k}={optim[k]!r}" for k in PLAIN_KEYS if optim.get(k) not in (None, 0, 0.0))
    scaled = model.get("depth_scaling") == "inverse_depth"
    depth = [v for k, v in model.items() if k in ("depth", "n_layer")] or [None]
    alpha = (f"scale_residual_branches(model, residual_alpha({depth[0] or 'K'}, k_base={model.get('k_base', 2)}))"
             "  # alpha = K_base/K, as the proxies ran") if scaled else ""
    depth_import = "from moga.depth import residual_alpha, scale_residual_branches\n" if scaled else ""
    if name in OPTIMIZER_CLASSES:
        cls = OPTIMIZER_CLASSES[name]
        plain = f"from moga import {cls}\n{depth_import}{alpha + chr(10) if alpha else ''}opt = {cls}(model, lr={lr!r}{kwargs})"
        hf_opt = f'opt = create_optimizer(model, args, name="{name}"{kwargs})'
    else:
        plain = f"opt = torch.optim.AdamW(model.parameters(), lr={lr!r})"
        hf_opt = "opt = None  # Trainer's own AdamW at learning_rate"
    steps = cfg.get("train", {}).get("steps")
    hf = (f"from transformers import Trainer, TrainingArguments\nfrom moga.integrations.hf import create_optimizer\n"
          f"{depth_import}{alpha + chr(10) if alpha else ''}"
          f"args = TrainingArguments(\"out\", learning_rate={lr!r}, max_steps={steps or -1})\n{hf_opt}\n"
          "trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))")
    return {"config": str(path), "moga_train": f"moga train {path} -o runs/target",
            "torchrun": f"torchrun --nproc-per-node 8 -m moga.train {path} train.parallel=fsdp -o runs/target",
            "hf_trainer": hf, "pytorch": plain}


def render(r: dict, short: bool = False) -> str:
    t = r["target"]
    lines = [f"# moga tune: {r['model']} at {t['label']} with {r['optimizer']}" if not short else
             f"target {t['label']} ({t['params']:,} parameters), {r['optimizer']}, depth scaling {r['depth_scaling']}"]
    if not short:
        lines += ["", *[f"- {x}" for x in r.get("notes", []) + r["plan"]["reasons"]], "", "## Proxies", "",
                  "| proxy | parameters | steps | best lr (grid) | refined optimum | seeds | curve (lr: loss) |",
                  "|---|---|---|---|---|---|---|"]
        for p in r["proxies"]:
            curve = ", ".join(f"{lr:g}: {loss:.4g}" for lr, loss in zip(p["curve"]["lrs"], p["curve"]["loss"]))
            lines.append(f"| {p['label']} | {p['params']:,} | {p['steps']} | {p['best_lr']} | "
                         f"{p['optimum_lr'] and round(p['optimum_lr'], 6)} | {p['seeds']} | {curve} |")
        lines += ["", f"Transfer among the proxies: {r['decision']['line']}", ""]
    pred = r.get("prediction")
    if r.get("rate") is None:
        lines.append("no rate: " + "; ".join(r["why"]))
    else:
        lines.append(f"rate for the target: {r['rate']:.6g} (2^{pred['log2_lr']:.2f}; "
                     + ("the proxies' mean optimum: their optima show no trend beyond noise"
                        if pred["rule"] == "mean" else "the proxies' trend extrapolated to the target") + ")")
        lines.append(f"predicted regret at the target: {_pct_2dp(pred['regret'])}"
                     f"{bracketed(pred['regret_interval'], _pct_2dp)} "
                     f"(95% interval; optimum drift {pred['slope']:+.3f} log2 per doubling of parameters"
                     f"{bracketed(pred['slope_interval'], lambda v: f'{v:+.3f}')})")
        lines.append(("extrapolating is justified: " if r["justified"] else "extrapolating is NOT justified: ")
                     + "; ".join(r["why"]))
    for n in r.get("next", []):
        lines.append(f"next: {n}")
    f = r["flops"]
    lines.append(f"tuning FLOPs {f['tuning']:.3g} ({f['cells']} cells) against {f['at_target']:.3g} for "
                 f"{f['cells_per_proxy_at_target']} cells at the target: {100 * f['saved']:.0f}% saved")
    if "cells_trained" in r:
        lines.append(f"cells trained by this call: {r['cells_trained']}")
    s = r.get("snippets")
    if s:
        if short:
            lines += [f"config: {s['config']}", f"run: {s['moga_train']}", f"     {s['torchrun']}"]
        else:
            lines += ["", "## Run the target", "", f"```bash\n{s['moga_train']}\n{s['torchrun']}\n```", "",
                      "Hugging Face Trainer:", "", f"```\n{s['hf_trainer']}\n```", "", "Plain PyTorch:", "",
                      f"```\n{s['pytorch']}\n```", "", "## The model behind the prediction", "",
                      "The refined optimum log2(lr*) of each proxy moves linearly in log2(parameters); near its "
                      "optimum the target's loss is a parabola in log2(lr) with the largest proxy's relative "
                      "curvature. Intervals: the sweep report's seed bootstrap, refitting curves, line and "
                      "curvature in every resample (moga.experiments.tune.predict)."]
    return "\n".join(lines) + "\n"
