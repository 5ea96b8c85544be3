"""The Python half of scripts/gpu-check.sh: the checks that need CUDA, each a subcommand that prints one
JSON line (the shell script collects them into the summary). Only torch and moga are imported.

    python scripts/gpu_check.py precheck            # exits 2 with one clear line when there is no CUDA
    python scripts/gpu_check.py syncs               # host syncs per optimizer step (set_sync_debug_mode)
    python scripts/gpu_check.py kernel              # CUDA steps against the CPU's: the op's, and the compiled one
    python scripts/gpu_check.py lines LOG           # the summary lines of a syncs or kernel log
    python scripts/gpu_check.py config DIR          # writes a char-level GPT config and its corpus into DIR
    python scripts/gpu_check.py tokens RUN_DIR      # median tokens/s of a run's logged train records
    python scripts/gpu_check.py same RUN_A RUN_B    # max weight and loss difference of two sharded runs
"""

from __future__ import annotations

import json
import statistics
import sys
import warnings
from pathlib import Path


def precheck() -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
              "nothing to check: run it on a machine with a GPU")
        return 2
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "device": torch.cuda.get_device_name(0)}))
    return 0


def syncs(steps: int = 3) -> int:
    """Each optimizer on GPT-2-small-shaped CUDA parameters: host syncs per step after 3 warm-up steps (which
    compile), counted by torch.cuda.set_sync_debug_mode("warn"); and the step's max difference to the same
    optimizer on CPU copies (a compiled CUDA kernel against the C++ one)."""
    import torch

    from moga.bench.optimizer import GPT2_SMALL_BLOCK
    from moga.optim import MOGA, Muon, ScaledAdamW

    makers = {
        "moga-row-p2": lambda ps: MOGA(ps, lr=1e-3, geometry="row(p=2)"),
        "moga-row-p2-flag": lambda ps: MOGA(ps, lr=1e-3, geometry="row(p=2)"),
        "moga-col-q2": lambda ps: MOGA(ps, lr=1e-3, geometry="col(q=2)"),
        "moga-row-p2-bf16-master": lambda ps: MOGA(ps, lr=1e-3, geometry="row(p=2)", master_weights=True),
        "muon": lambda ps: Muon(ps, lr=1e-3),
        "scaled-adamw": lambda ps: ScaledAdamW(ps, lr=1e-3),
    }
    gen = torch.Generator().manual_seed(0)
    shapes = GPT2_SMALL_BLOCK
    out = {}
    for name, make in makers.items():
        dtype = torch.bfloat16 if "bf16" in name else torch.float32
        host = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(dtype)) for s in shapes]
        grads = [(torch.randn(s, generator=gen) * 1e-3).to(dtype) for s in shapes]
        dev = [torch.nn.Parameter(p.detach().cuda()) for p in host]
        for p, q, g in zip(host, dev, grads):
            p.grad, q.grad = g, g.cuda()
        opts = make(host), make(dev)
        flag = torch.zeros((), device="cuda") if name.endswith("-flag") else None
        kwargs = {} if flag is None else {"found_inf": flag}
        try:
            for _ in range(3):
                opts[1].step(**kwargs)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(steps):
                        opts[1].step(**kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            found = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
            for _ in range(3 + steps):
                opts[0].step()
            diff = max((a.float() - b.float().cpu()).abs().max().item() for a, b in zip(host, dev))
            out[name] = {"syncs_per_step": len(found) / steps, "first": found[:2], "max_diff_vs_cpu": diff}
        except Exception as e:  # one optimizer's failure is a finding, not the end of the check
            out[name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    print(json.dumps(out))
    return 0 if all("error" not in v and v["syncs_per_step"] == 0 for v in out.values()) else 1


def kernel() -> int:
    """MOGA's row and col steps on CUDA against the same steps on CPU copies (6 steps), as the optimizer runs
    them, and the compiled step (:mod:`moga.kernels.compiled`, not dispatched) against the reference on one
    CUDA Parameter. Each difference is set beside the size of the update itself; the optimizer's must be far
    smaller (exit 1 otherwise), the compiled one's is reported (on an H200 it was larger than the update)."""
    import torch

    from moga.bench.optimizer import GPT2_SMALL_BLOCK
    from moga.kernels import compiled, reference
    from moga.optim import MOGA

    out = {}
    for geometry in ("row(p=2)", "col(q=2)"):
        gen = torch.Generator().manual_seed(0)
        host = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in GPT2_SMALL_BLOCK]
        before = [p.detach().clone() for p in host]
        dev = [torch.nn.Parameter(p.detach().cuda()) for p in host]
        for p, q in zip(host, dev):
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
            q.grad = p.grad.cuda()
        opts = MOGA(host, lr=1e-3, geometry=geometry), MOGA(dev, lr=1e-3, geometry=geometry)
        for _ in range(6):
            opts[0].step()
            opts[1].step()
        out[f"optimizer {geometry}"] = {
            "max_diff": max((a - b.detach().cpu()).abs().max().item() for a, b in zip(host, dev)),
            "update": max((a - b).abs().max().item() for a, b in zip(host, before))}
    gen = torch.Generator().manual_seed(1)
    w0, g, m0 = (torch.randn(768, 3072, generator=gen) * s for s in (0.02, 1e-3, 1e-3))
    for layout, shape in (("row", [768, 3072, 1]), ("col", [1, 768, 3072])):
        ref_w, ref_m = [w0.clone()], [m0.clone()]
        reference.tensor_steps_(ref_w, [g], ref_m, None, shape, [-1e-3], 2.0, 0.9, True, 1.0)
        w, m = [torch.nn.Parameter(w0.cuda())], [m0.cuda()]
        try:
            with torch.no_grad():
                compiled.compiled_steps_(w, [g.cuda()], m, None, shape, [-1e-3], 2.0, 0.9, True, 1.0)
            out[f"compiled {layout}"] = {"max_diff": (w[0].detach().cpu() - ref_w[0]).abs().max().item(),
                                         "update": (ref_w[0] - w0).abs().max().item()}
        except Exception as e:  # a finding, not the end of the check
            out[f"compiled {layout}"] = {"error": f"{type(e).__name__}: {str(e).strip()[:200]}"}
    print(json.dumps(out))
    return 0 if all(v["max_diff"] < 0.01 * v["update"] for k, v in out.items() if k.startswith("optimizer")) else 1


def lines(log: str) -> int:
    """One summary line per optimizer or step of a ``syncs`` or ``kernel`` log (its JSON line; the rest is noise)."""
    for line in Path(log).read_text().splitlines():
        if not line.startswith("{"):
            continue
        for name, r in json.loads(line).items():
            if "error" in r:
                said = r["error"]
            elif "syncs_per_step" in r:
                said = (f"{r['syncs_per_step']:g} host syncs/step, max |CUDA - CPU| {r['max_diff_vs_cpu']:.1e}"
                        + (f" ({r['first'][0]})" if r["first"] else ""))
            else:
                said = f"max |CUDA - CPU| {r['max_diff']:.1e} against an update of {r['update']:.1e}"
            print(f"  {name}: {said}")
    return 0


def config(directory: str) -> int:
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"To be, or not to be, line {i}: that is the question. Whether 'tis nobler "
                              f"in the mind to suffer the slings and arrows of outrageous fortune {i % 97}.\n"
                              for i in range(4000)), encoding="utf-8")
    cfg = {
        "seed": 0,
        "model": {"name": "gpt", "n_layer": 4, "n_embd": 256, "n_head": 4, "dropout": 0.0},
        "data": {"name": "text", "text_path": str(corpus), "block_size": 128},
        "optim": {"name": "moga", "lr": 2**-5},
        "train": {"steps": 60, "batch_size": 32, "device": "cuda", "precision": "bf16"},
        "eval": {"every": 0},
        "checkpoint": {"every": 0},
        "logging": {"log_every": 10},
    }
    (root / "config.yaml").write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    print(json.dumps({"config": str(root / "config.yaml")}))
    return 0


def tokens(run_dir: str) -> int:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    rates = [r["tokens_per_s"] for r in records if r.get("type") == "train" and "tokens_per_s" in r][1:]  # not the compile
    losses = [r["loss"] for r in records if r.get("type") == "train"]
    print(json.dumps({"tokens_per_s": statistics.median(rates) if rates else None,
                      "final_loss": losses[-1] if losses else None}))
    return 0 if rates else 1


def same(run_a: str, run_b: str) -> int:
    import torch

    from moga.train.sharded_checkpoint import DIRECTORY, consolidate

    for d in (run_a, run_b):
        result = json.loads((Path(d) / "result.json").read_text()) if (Path(d) / "result.json").is_file() else {}
        if result.get("status") != "finished":  # a diverged run keeps no checkpoint to compare
            print(json.dumps({"run": str(d), "status": result.get("status"), "steps": result.get("steps")}))
            return 1
    a, b = (consolidate(Path(d) / DIRECTORY) for d in (run_a, run_b))
    diff = max((a["model"][k].float() - b["model"][k].float()).abs().max().item()
               for k in a["model"] if torch.is_tensor(a["model"][k]))
    print(json.dumps({"max_weight_diff": diff, "bitwise": diff == 0.0}))
    return 0 if diff < 1e-5 else 1


if __name__ == "__main__":
    command, *args = sys.argv[1:] or ["precheck"]
    commands = {"precheck": precheck, "syncs": syncs, "kernel": kernel, "lines": lines, "config": config,
                "tokens": tokens, "same": same}
    if command not in commands:
        sys.exit(f"gpu_check.py: unknown command {command!r}; one of {', '.join(commands)}")
    sys.exit(commands[command](*args))
