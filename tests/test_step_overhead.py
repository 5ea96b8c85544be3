"""scripts/step_overhead.py: the kernel's call is timed apart from the step around it."""

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "step_overhead.py"


def load():
    spec = importlib.util.spec_from_file_location("step_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kernel_call_is_seen_and_timed_apart_from_the_step():
    import moga.kernels.step as kernel_step

    before, threads = kernel_step._op, torch.get_num_threads()
    torch.set_num_threads(1)  # as the script runs: with more, the pool's spinning counts as time outside
    try:
        times = load().measure(["moga-row-p2-flag"], rounds=2)["moga-row-p2-flag"]
    finally:
        torch.set_num_threads(threads)
    assert kernel_step._op is before  # the timing wrapper is taken out again
    assert len(times["step"]) == 2
    # the step goes through the timed call: the kernel's time is seen, and is most of the step
    for inside, step in zip(times["inside"], times["step"]):
        assert inside / 1e3 > 0.5 * step
