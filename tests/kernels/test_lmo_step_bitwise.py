"""The C++ kernel's output, bit for bit, against digests recorded from an earlier build of it: a rewrite of
``lmo_step.cpp`` (or of the plan that feeds it) that changes any bit of any output fails here.

The cases: every geometry the kernel covers and two it leaves alone (p = inf), p in {1, 1.5, 2, 2.5, 3.2}
(the fast exponents and pow), row and column mode, layouts oi, io, boi and oiii, odd shapes (a column
chunk cut short, a single row or column), float32, float64 and bfloat16 (float32 math on bfloat16
storage), no momentum, momentum and Nesterov, weight decay, and rows whose sums under- or overflow (the
exact path in double); three steps each through ``fused_lmo_step_``, and the split step's two library
ops (``lmo_partials``, ``lmo_apply``: its sums, flags and outputs) on the same inputs.

Floating-point results depend on the vector width, the compiler's contractions and torch's at::vec, so
the digests are kept per platform key (CPU capability, torch, compiler); elsewhere the test skips. The
AVX2 and DEFAULT keys were recorded on an AVX-512 machine from the kernel before its rewrite, built for those
capabilities; ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``) runs this test against them on any x86 CPU that
has AVX2. To record them for the kernel as built here (only from a kernel known to be right, e.g. before a
rewrite):

    python -m tests.kernels.test_lmo_step_bitwise --write
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moga.geometry import parse_geometry
from moga.kernels import fused_lmo_step_
from moga.kernels.build import capability, load_extension
from moga.layout import Layout

DIGESTS = Path(__file__).with_name("lmo_step_digests.json")

SPECS = ["row(p=1)", "row(p=1.5)", "row(p=2)", "row(p=2.5)", "row(p=3.2)", "row(p=inf)", "col(q=2)", "col(q=3)",
         "col(q=1.6666666666666667)", "col(q=inf)", "col(q=1)", "sign", "embedding(q=2)", "embedding(q=3)"]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MOMENTA = {"plain": (0.0, False, 0.0), "momentum": (0.9, False, 0.1), "nesterov": (0.9, True, 0.05)}
# (shape, layout): row and column mode, (130, 9) has five column chunks, the last short
SHAPES = [((7, 13), "oi"), ((7, 13), "io"), ((33, 257), "oi"), ((130, 9), "oi"), ((130, 9), "io"), ((1, 40), "oi"),
          ((40, 1), "oi"), ((3, 4, 5), "boi"), ((4, 3, 2, 3), "oiii")]
SPLIT_P = [1.5, 2.0, 2.5, 3.2]
SPLIT_SHAPES = [(5, 37, 1), (2, 45, 9), (1, 130, 17)]  # (B, K, N): row mode, column mode


def platform_key() -> str:
    cxx = shutil.which("c++") or "c++"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        version = "unknown compiler"
    return f"{capability()} | torch {torch.__version__} | {version}"


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:20]


def inputs(shape, dtype, seed, steps=3):
    """W and ``steps`` gradients; some lines scaled to 1e-30, 1e30 and zero (the exact path), by row and column."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = []
    for s in range(steps):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        flat = g.reshape(shape[0], -1)
        if s == 1 and flat.shape[0] > 3:
            flat[0] *= 1e-30
            flat[1] *= 1e30
            flat[2] = 0
        if s == 2 and flat.shape[1] > 3:
            flat[:, 0] *= 1e-30
            flat[:, 1] *= 1e30
        grads.append(g.to(dtype))
    return w.to(dtype), grads


def step_case(spec: str, dtype: torch.dtype, mode: str) -> str:
    """Three steps of every shape through ``fused_lmo_step_``: W, the momentum buffer and what was left over."""
    momentum, nesterov, wd = MOMENTA[mode]
    geometry = parse_geometry(spec)
    out = []
    for seed, (shape, layout) in enumerate(SHAPES):
        w, grads = inputs(shape, dtype, seed)
        m = torch.zeros_like(w) if momentum else None
        for g in grads:
            left = fused_lmo_step_(geometry, [Layout(layout)], [w], [g], [m] if momentum else None, 0.1, momentum,
                                   nesterov, wd)
            out.append(torch.tensor(left, dtype=torch.int64))
        out += [w] + ([m] if momentum else [])
    return digest(out)


def split_case(p: float, dtype: torch.dtype, mode: str) -> str:
    """The split step's library ops on one rank (its local sums are the combined ones): sums, flags, W, m."""
    momentum, nesterov, wd = MOMENTA[mode]
    lib = load_extension()
    out = []
    for seed, shape in enumerate(SPLIT_SHAPES):
        w, grads = inputs(shape, dtype, 100 + seed)
        m = [torch.zeros_like(w)] if momentum else []
        for g in grads:
            parts = lib.lmo_partials([g], m, None, list(shape), p, momentum, nesterov)
            flags = lib.lmo_apply([w], [g], m, None, list(shape), [-0.1 * 0.7], parts, p, momentum, nesterov,
                                  1 - 0.1 * wd)
            out += [*parts, *flags]
        out += [w, *m]
    return digest(out)


def all_digests() -> dict[str, str]:
    torch.set_num_threads(min(torch.get_num_threads(), 2))  # the kernel's result does not depend on it
    found = {}
    for dname, dtype in DTYPES.items():
        for mode in MOMENTA:
            for spec in SPECS:
                found[f"step {spec} {dname} {mode}"] = step_case(spec, dtype, mode)
            for p in SPLIT_P:
                found[f"split p={p} {dname} {mode}"] = split_case(p, dtype, mode)
    return found


def test_kernel_output_is_bitwise_unchanged():
    recorded = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    key = platform_key()
    if key not in recorded:
        pytest.skip(f"no digests recorded for this platform ({key}); see this file's docstring")
    load_extension()
    now = all_digests()
    changed = sorted(case for case, value in recorded[key].items() if now.get(case) != value)
    assert set(now) == set(recorded[key]), "the case table changed: record the digests again"
    assert not changed, f"{len(changed)} of {len(now)} cases changed bits, e.g.:\n" + "\n".join(changed[:20])


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    recorded = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    load_extension()
    recorded[platform_key()] = all_digests()
    DIGESTS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(recorded[platform_key()])} digests for {platform_key()} in {DIGESTS}")
