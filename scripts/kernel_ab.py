"""A/B timing of two builds of the C++ kernel (src/moga/kernels/lmo_step.cpp) side by side in one process.

    python scripts/kernel_ab.py OLD NEW [--dtype bfloat16] [--mode row] [--p 2] [--rounds 21]

OLD and NEW are git revisions (``REV`` means ``REV:src/moga/kernels/lmo_step.cpp``) or paths to a
lmo_step.cpp. Each is built with the flags of ``moga.kernels.build`` under its own op namespace, then both
step the same GPT-2-small-shaped matrices (two blocks, momentum 0.9, weight decay) in turns, A B B A
every round, so a shared host that speeds up or slows down hits both alike. Prints each
build's median ms, the median (and range) of the per-round ratio NEW / OLD, and whether the two builds
left bitwise equal weights and momenta (the exit status says so too).

On a busy host, ``--threads 1 --clock cpu`` times the calling thread's CPU time: a thread the host
takes off the CPU is not counted (with two threads, one descheduled thread stalls the other's wait at
the end of every parallel region). ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``) builds and times another
at::vec flavour on the same machine. Builds are cached in the temporary directory, by source and flags.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from moga.kernels.build import LDFLAGS, build_recipe

SOURCE = "src/moga/kernels/lmo_step.cpp"
BLOCK = [(768, 768)] * 4 + [(3072, 768), (768, 3072)]


def source_of(spec: str) -> str:
    path = Path(spec)
    if path.is_file():
        return path.read_text()
    return subprocess.run(["git", "show", f"{spec}:{SOURCE}"], capture_output=True, text=True, check=True).stdout


def build(tag: str, code: str, root: Path):
    """The kernel's ops under the namespace ``moga_ab_<tag>`` (two builds cannot share one)."""
    namespace = f"moga_ab_{tag}"
    code = code.replace("TORCH_LIBRARY(moga_kernels,", f"TORCH_LIBRARY({namespace},")
    code = code.replace("TORCH_LIBRARY_IMPL(moga_kernels,", f"TORCH_LIBRARY_IMPL({namespace},")
    _, _, flags, _ = build_recipe()
    directory = root / f"{namespace}_{hashlib.sha256((code + ' '.join(flags)).encode()).hexdigest()[:12]}"
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "lmo_step.cpp"
    if not source.is_file() or source.read_text() != code:  # a new mtime would make ninja rebuild
        source.write_text(code)
    cpp_extension.load(name=namespace, sources=[str(source)], extra_cflags=list(flags),
                       extra_ldflags=list(LDFLAGS), build_directory=str(directory), is_python_module=False)
    return getattr(torch.ops, namespace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--mode", default="row", choices=["row", "col"])
    parser.add_argument("--p", type=float, default=2.0)
    parser.add_argument("--nesterov", action="store_true")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=2, help="steps per timing (two timings per build per round)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the calling thread's CPU time (with --threads 1: time the host takes away is not counted)")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu times the calling thread only: use it with --threads 1")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    root = Path(tempfile.gettempdir()) / "moga-kernel-ab"  # builds cached by source
    libs = {name: build(name, source_of(spec), root) for name, spec in (("a", args.old), ("b", args.new))}
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    shapes = BLOCK * args.blocks
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    dims = [((o, i, 1) if args.mode == "row" else (1, o, i)) for o, i in shapes]
    flat = [d for dim in dims for d in dim]
    weights = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    state = {name: ([w.clone() for w in weights], [torch.zeros(s, dtype=dtype) for s in shapes]) for name in libs}

    def step(name: str) -> float:
        ws, ms = state[name]
        start = clock()
        for _ in range(args.steps):
            libs[name].lmo_step(ws, grads, ms, None, flat, [-1e-3] * len(ws), args.p, 0.9, args.nesterov,
                                1 - 1e-3 * 0.1)
        return (clock() - start) / args.steps

    for name in libs:  # warm-up
        step(name)
    times = {name: [] for name in libs}
    ratios = []
    for _ in range(args.rounds):  # A B B A: a linear drift within the round cancels
        got = {"a": step("a"), "b": step("b")}
        got = {"b": (got["b"] + step("b")) / 2, "a": (got["a"] + step("a")) / 2}
        for name in libs:
            times[name].append(got[name])
        ratios.append(got["b"] / got["a"])
    ok = all(torch.equal(x, y) for x, y in zip(state["a"][0] + state["a"][1], state["b"][0] + state["b"][1]))
    print(f"{args.dtype} {args.mode}(p={args.p}) nesterov={args.nesterov}, {args.blocks} blocks, "
          f"{args.rounds} rounds, {torch.get_num_threads()} threads, {args.clock} time")
    print(f"old {args.old}: {1e3 * statistics.median(times['a']):.2f} ms   new {args.new}: "
          f"{1e3 * statistics.median(times['b']):.2f} ms")
    print(f"new / old: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}; "
          f"outputs {'bitwise equal' if ok else 'DIFFER'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
