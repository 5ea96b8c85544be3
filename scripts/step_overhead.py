"""How long MOGA's step spends outside the fused kernel when the caches are cold, as in `moga bench optimizer`.

    python scripts/step_overhead.py [--rounds 80] [--record moga-row-p2-flag --record moga-row-p2-kernel]

Each round runs torch's fused AdamW step first (it streams ~400 MB through the caches, as the bench's previous
record and a training step's forward and backward do), then one step of each record on its own parameters,
with the bench's GPT-2-small-shaped matrices and gradients, on 1 thread. The time inside the C++ kernel's call
is taken apart from the step's own, so what is left is the Python, the ops and the dispatch around it. Prints,
per record, the median (quartiles) over rounds of the time outside the kernel and of the whole step, CPU time.
On small matrices, where nothing evicts them, the same steps take 50-90 us in all (docs/results.md): most of
the time measured here is fetching again the code and data that the streaming steps evicted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import moga.kernels.step as kernel_step
from moga.bench.optimizer import GPT2_SMALL_BLOCK, OPTIMIZERS, make_optimizers


def measure(records: list[str], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per record, per round: ``outside`` (us) and ``inside`` (us) the kernel's call, and the ``step`` (ms)."""
    inside = [0.0]
    library_op = kernel_step._op

    def timed_op(name, device):  # the kernel's own call, timed
        op = library_op(name, device)

        def call(*a, **k):
            start = time.process_time()
            try:
                return op(*a, **k)
            finally:
                inside[0] += time.process_time() - start
        return call

    opts = make_optimizers(["torch-adamw-fused", *records], GPT2_SMALL_BLOCK * 2)  # the bench's two blocks
    adamw = opts.pop("torch-adamw-fused")
    times = {name: {"outside": [], "inside": [], "step": []} for name in records}
    kernel_step._op = timed_op
    try:
        for r in range(rounds + 3):
            for name, opt in opts.items():
                adamw.step()
                inside[0] = 0.0
                start = time.process_time()
                opt.step()
                elapsed = time.process_time() - start
                if r >= 3:  # the first rounds build the kernel and the state
                    times[name]["outside"].append((elapsed - inside[0]) * 1e6)
                    times[name]["inside"].append(inside[0] * 1e6)
                    times[name]["step"].append(elapsed * 1e3)
    finally:
        kernel_step._op = library_op
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--record", action="append", choices=[n for n in OPTIMIZERS if n.startswith("moga")])
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (quartiles need two)")
    records = args.record or ["moga-row-p2-flag", "moga-row-p2-kernel"]
    torch.set_num_threads(1)  # as the bench's --threads 1: the CPU clock then counts one thread
    for name, t in measure(records, args.rounds).items():
        q = statistics.quantiles(t["outside"], n=4)
        w = statistics.quantiles(t["step"], n=4)
        print(f"{name:28s} outside the kernel {q[1]:6.0f} us ({q[0]:.0f}-{q[2]:.0f}); "
              f"step {w[1]:.2f} ms ({w[0]:.2f}-{w[2]:.2f})")


if __name__ == "__main__":
    main()
