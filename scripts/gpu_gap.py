"""The gap's trend in width on one GPU (docs/reproductions.md, "The gap's trend in width"): row(2) against the
orthogonalized step on the hidden matrices, every other role MOGA's default, each tuned, at widths 512-4096.

It imports only torch and moga's optimizers, models and smoothness library (no pydantic, no transformers: a GPU
image may lack them), so the LLaMA arm is the built-in GPT's ``style="llama"`` (RMSNorm, rotary, SwiGLU), not
the Hugging Face model of the CPU claim. Width by width, as the CPU claim runs: the first width's lr grid, then
from the second on three rates around each contender's best at the smaller width (widened a step while the best
sits on that edge), and seeds 1 and 2 at each best rate; the hidden momentum's alignment is recorded at the end
of each seed-1 run. Runs stop being started when ``--budget-s`` would be passed; what ran is written anyway.

``--arm hybrid`` runs issue 35's item 4 the same way instead: MuonEq's ``row_spectral`` on the hidden matrices
with MOGA's default preset on the other roles (weight decay 0) against the published ``Muon(model)`` (AdamW on
tables, head and vectors; weight decay 0.1), as configs/research/hybrid_gap.yaml does on the CPU, into
``OUT_DIR/hybrid-cells.json``.

    python scripts/gpu_gap.py plan [--widths 512,1024,2048,4096] ...   # FLOPs and estimated seconds, no GPU
    python scripts/gpu_gap.py run OUT_DIR [--device cuda] [--text FILE] [--budget-s 540] ...

``OUT_DIR/gap-cells.json`` (or ``hybrid-cells.json``) holds every run's final training loss in the stored claim's
cell form; judge it here with ``python -m moga.experiments.reproduce.gap cells OUT_DIR/gap-cells.json`` (gap per
width with its seed interval, slope against log2(width), verdict).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROW, ORTH, HYBRID, MUON = "row(p=2)", "spectral", "row_spectral", "muon"
ARMS = {"gap": (ROW, ORTH), "hybrid": (HYBRID, MUON)}  # (subject, baseline)
GRID = {ROW: [2.0**k for k in range(-8, 1)], ORTH: [2.0**k for k in range(-10, 0)],  # how far widening may go
        HYBRID: [2.0**k for k in range(-10, 0)], MUON: [2.0**k for k in range(-11, -1)]}
FIRST = {ROW: [2.0**k for k in range(-5, 0)], ORTH: [2.0**k for k in range(-7, -2)],  # CPU optima: 2^-3, 2^-5
         HYBRID: [2.0**k for k in range(-7, -2)], MUON: [2.0**k for k in range(-8, -3)]}  # 2^-5; 2^-5 to 2^-6
SEEDS = 3
# Assumed H200 rates for the plan (bf16): the model's matmuls at about 40% of 790 TFLOP/s, Newton-Schulz's
# square ones at about 50%, and a floor of 12 ms a step (Python and kernel launches of a 2-layer model: 300-step
# runs at widths 512-1024 took 3.2-5 s on an H200 shared by three jobs, 2026-12-04; at 2048, 5.6-12 s).
MODEL_FLOPS, NS_FLOPS, STEP_FLOOR_S = 3.0e14, 4.0e14, 12e-3


def arguments(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["plan", "run"])
    p.add_argument("out", nargs="?", default="gpu-gap")
    p.add_argument("--device", default="cuda")
    p.add_argument("--arm", choices=sorted(ARMS), default="gap", help="gap: row(2) against the orthogonalized "
                   "step; hybrid: row_spectral against the published Muon")
    p.add_argument("--text", default=None, help="a text file (default $MOGA_DATA/tinyshakespeare.txt, else a "
                   "generated corpus)")
    p.add_argument("--widths", default="512,1024,2048,4096")
    p.add_argument("--models", default="gpt,llama", help="gpt and/or llama (the built-in GPT's llama style)")
    p.add_argument("--llama-widths", default="512,1024,2048", help="the llama arm's widths (budget)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--window", type=int, default=20, help="final loss: the mean of the last WINDOW steps")
    p.add_argument("--budget-s", type=float, default=540.0)
    return p.parse_args(argv)


# --- cost ---------------------------------------------------------------------------------------------------

def hidden_shapes(width: int, style: str) -> list[tuple[int, int]]:
    mlp = 8 * math.ceil(8 * width / 3 / 8) if style == "llama" else 4 * width
    if style == "llama":
        return [(3 * width, width), (width, width), (mlp, width), (mlp, width), (width, mlp)]
    return [(3 * width, width), (width, width), (mlp, width), (width, mlp)]


def run_seconds(width: int, style: str, a, orthogonalized: bool) -> float:
    shapes = hidden_shapes(width, style) * a.layers
    params = sum(m * n for m, n in shapes)
    tokens = a.batch * a.block
    model = (6 * params + 12 * a.layers * a.block * width) * tokens
    ns = sum(5 * (4 * min(m, n) ** 2 * max(m, n) + 2 * min(m, n) ** 3) for m, n in shapes) if orthogonalized else 0
    return a.steps * max(STEP_FLOOR_S, model / MODEL_FLOPS + ns / NS_FLOPS)


def plan(a) -> list[dict]:
    """Estimated seconds per model and width: the grid (5 rates at the first width, 3 after) and the seeds."""
    rows = []
    for style, widths in styles(a):
        for i, w in enumerate(widths):
            rates = 5 if i == 0 else 3
            s = {g: run_seconds(w, style, a, g != ROW) for g in ARMS[a.arm]}
            total = sum((rates + SEEDS - 1) * v for v in s.values())
            subject, baseline = ARMS[a.arm]
            rows.append({"model": style, "width": w, "subject_run_s": round(s[subject], 1),
                         "baseline_run_s": round(s[baseline], 1),
                         "runs": 2 * (rates + SEEDS - 1), "seconds": round(total, 1)})
    return rows


def styles(a) -> list[tuple[str, list[int]]]:
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = set(models) - {"gpt", "llama"}
    if unknown:
        raise SystemExit(f"gpu_gap.py: --models takes gpt and llama, got {sorted(unknown)}")
    widths = [int(w) for w in a.widths.split(",")]
    llama = [int(w) for w in a.llama_widths.split(",")]
    return [(m, widths if m == "gpt" else [w for w in widths if w in llama]) for m in models]


# --- one run ------------------------------------------------------------------------------------------------

def corpus(a, device):
    import os

    import torch

    path = Path(a.text) if a.text else Path(os.environ.get("MOGA_DATA", "")) / "tinyshakespeare.txt"
    if path.is_file():
        text, source = path.read_text(encoding="utf-8"), path.name
    else:  # a stand-in with some structure, when no text travelled
        words = ["the", "king", "queen", "of", "to", "be", "not", "what", "night", "day", "love", "death"]
        text = " ".join(words[(i * i + 3 * i) % len(words)] + (".\n" if i % 11 == 10 else "") for i in range(300_000))
        source = "generated"
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text[: 2_000_000]], dtype=torch.long)
    return data.to(device), len(chars), source


def train(width: int, style: str, hidden: str, lr: float, seed: int, a, data, vocab: int, device,
          measure: bool = False) -> dict:
    import torch

    from moga.models import GPT
    from moga.optim import MOGA, Muon
    from moga.smoothness.alignment import hidden_alignment

    torch.manual_seed(seed)
    model = GPT(vocab_size=vocab, block_size=a.block, n_layer=a.layers, n_embd=width,
                n_head=max(1, width // a.head_dim), style="llama" if style == "llama" else "gpt2").to(device)
    overrides = model.plan_overrides() or None  # a tied head, as the training engine passes it
    if hidden == MUON:
        opt = Muon(model, lr=lr, weight_decay=0.1, overrides=overrides)
    elif hidden == HYBRID:
        opt = MOGA(model, lr=lr, weight_decay=0.0, geometries={"hidden": hidden}, overrides=overrides)
    else:
        opt = MOGA(model, lr=lr, preset="paper", nesterov=True, lr_multipliers={"embedding": 1 / 16},
                   geometries={"hidden": hidden}, overrides=overrides)
    initial = [g["lr"] for g in opt.param_groups]
    gen = torch.Generator().manual_seed(10_000 + seed)
    warm = max(1, int(0.1 * a.steps))
    losses = []
    t0 = time.perf_counter()
    for step in range(a.steps):
        frac = (step + 1) / warm if step < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, a.steps - warm)))
        for g, lr0 in zip(opt.param_groups, initial):
            g["lr"] = lr0 * frac
        starts = torch.randint(0, data.numel() - a.block - 1, (a.batch,), generator=gen)
        idx = starts[:, None] + torch.arange(a.block + 1)
        batch = data[idx.to(data.device)]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        if (step + 1) % 50 == 0 and not (math.isfinite(float(losses[-1])) and float(losses[-1]) < 10.0):
            break  # diverged: its loss counts as inf
    tail = torch.stack(losses[-a.window:]).mean().item()
    out = {"train_loss": tail if len(losses) == a.steps and math.isfinite(tail) else math.inf,
           "seconds": round(time.perf_counter() - t0, 2)}
    if measure and math.isfinite(out["train_loss"]):
        found = hidden_alignment(opt, dtype=torch.float32)
        out["alignment"] = {k: found[k] for k in ("gram_dominance", "gram_coherence", "cosine", "matrices")}
    return out


# --- width by width -----------------------------------------------------------------------------------------

def best(cells: list[dict], **where) -> float | None:
    means: dict[float, list[float]] = {}
    for c in cells:
        if all(c[k] == v for k, v in where.items()):
            means.setdefault(c["lr"], []).append(c["train_loss"])
    most = max((len(v) for v in means.values()), default=0)
    finite = {lr: sum(v) / len(v) for lr, v in means.items() if len(v) == most and math.isfinite(sum(v))}
    return min(finite, key=lambda lr: (finite[lr], lr)) if finite else None


def run(a) -> int:
    import torch

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_gap.py: no CUDA device here; --device cpu runs it (slowly) on the CPU")
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data, vocab, source = corpus(a, device)
    start = time.perf_counter()
    cells, skipped = [], []
    estimate = {(r["model"], r["width"]): r for r in plan(a)}

    def one(style, w, hidden, lr, seed, measure=False):
        name = "moga.integrations.llama:llama" if style == "llama" else "gpt"
        left = a.budget_s - (time.perf_counter() - start)
        need = estimate[(style, w)]["subject_run_s" if hidden == ARMS[a.arm][0] else "baseline_run_s"]
        if left < need:
            skipped.append({"model": style, "width": w, "contender": hidden, "lr": lr, "seed": seed})
            return
        r = train(w, style, hidden, lr, seed, a, data, vocab, device, measure)
        cell = {"model.name": name, "contender": hidden, "scale": w, "lr": lr, "seed": seed,
                "status": "finished" if math.isfinite(r["train_loss"]) else "diverged",
                "train_loss": r["train_loss"], "seconds": r["seconds"], **({"alignment": r["alignment"]}
                                                                           if "alignment" in r else {})}
        cells.append(cell)
        print(json.dumps({k: v for k, v in cell.items()}), flush=True)
        write(out, cells, skipped, a, source)

    for style, widths in styles(a):
        name = "moga.integrations.llama:llama" if style == "llama" else "gpt"
        previous = {}
        for w in widths:
            for hidden in ARMS[a.arm]:
                grid = GRID[hidden]
                if hidden not in previous:
                    rates = list(FIRST[hidden])
                else:
                    i = grid.index(previous[hidden])
                    rates = grid[max(0, i - 1): i + 2]
                for lr in rates:
                    one(style, w, hidden, lr, 0)
                for _ in range(2):  # widen while the best sits on an edge the grid goes past
                    b = best(cells, **{"model.name": name, "contender": hidden, "scale": w})
                    if b is None or b not in (rates[0], rates[-1]):
                        break
                    i = grid.index(b) + (-1 if b == rates[0] else 1)
                    if not 0 <= i < len(grid):
                        break
                    rates = sorted(rates + [grid[i]])
                    one(style, w, hidden, grid[i], 0)
                b = best(cells, **{"model.name": name, "contender": hidden, "scale": w})
                if b is None:
                    continue
                previous[hidden] = b
                for seed in range(1, SEEDS):
                    one(style, w, hidden, b, seed, measure=seed == 1)
    write(out, cells, skipped, a, source)
    print(f"gpu_gap.py: {len(cells)} runs in {time.perf_counter() - start:.0f}s, {len(skipped)} skipped for the "
          f"budget; judge: python -m moga.experiments.reproduce.gap cells {out / cells_file(a)}")
    return 0


def write(out: Path, cells: list[dict], skipped: list[dict], a, source: str) -> None:
    import torch

    setup = {"steps": a.steps, "batch": a.batch, "block": a.block, "layers": a.layers, "head_dim": a.head_dim,
             "text": source, "device": str(a.device), "torch": torch.__version__,
             "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    expected = {"panels": [{"model.name": "moga.integrations.llama:llama" if s == "llama" else "gpt"}
                           for s, _ in styles(a)],
                "widths": {s: ws for s, ws in styles(a)}}  # by panel title
    subject, baseline = ARMS[a.arm]
    (out / cells_file(a)).write_text(json.dumps({"setup": setup, "subject": subject, "baseline": baseline,
                                                 "expected": expected, "cells": cells, "skipped": skipped},
                                                indent=1) + "\n")


def cells_file(a) -> str:
    return f"{a.arm}-cells.json"


def main(argv=None) -> int:
    a = arguments(sys.argv[1:] if argv is None else argv)
    if a.command == "plan":
        rows = plan(a)
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"total_seconds": round(sum(r["seconds"] for r in rows), 1), "budget_s": a.budget_s}))
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
