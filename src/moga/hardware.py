"""What this machine offers, read in one place so that tests can set each answer either way.

Choices that depend on the machine read :func:`facts`: the Newton-Schulz dtype under ``"auto"`` (bfloat16
on CPUs with bfloat16 matrix units) and the fused C++ kernel (needs a C++ compiler). ``with
assume(bf16_matmul=True): ...`` sets answers for a block, so both branches of each choice run on any
machine; ``$MOGA_ASSUME`` (``bf16_matmul=1,compiler=0``) sets them for a process and the processes it starts.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Hardware:
    bf16_matmul: bool  # the CPU multiplies bfloat16 matrices in hardware (AMX-BF16 or AVX512-BF16)
    compiler: bool  # a C++ compiler ($CXX, else c++) to build the fused CPU kernel


NAMES = tuple(f.name for f in fields(Hardware))
_assumed: list[dict[str, bool]] = []  # the stack of assume() blocks, innermost last


def traced_as_constant(fn):
    """``torch.compiler.assume_constant_result`` without its import of torch._dynamo, which is half of the
    cost of ``import moga`` (about 1 s): it only marks the function (a test keeps the two equal)."""
    fn._dynamo_marked_constant = True
    return fn


@traced_as_constant  # static within a compiled step
def facts() -> Hardware:
    """The machine as detected, with ``$MOGA_ASSUME`` and the active :func:`assume` blocks laid over it."""
    answers = dict(_from_env(os.environ.get("MOGA_ASSUME", "")))
    for block in _assumed:
        answers.update(block)
    return replace(detected(), **answers) if answers else detected()


@contextmanager
def assume(**answers: bool):
    """Within the block, :func:`facts` gives these answers (``assume(bf16_matmul=False, compiler=True)``)."""
    unknown = set(answers) - set(NAMES)
    if unknown or not all(isinstance(v, bool) for v in answers.values()):
        raise ValueError(f"assume() takes True/False for {', '.join(NAMES)}; got {answers!r}")
    _assumed.append(answers)
    try:
        yield facts()
    finally:
        _assumed.remove(answers)


@lru_cache(maxsize=1)
def detected() -> Hardware:
    return Hardware(bf16_matmul=_cpu_has_bf16_matmul(), compiler=shutil.which(os.environ.get("CXX", "c++")) is not None)


def _cpu_has_bf16_matmul() -> bool:
    """From the CPU flags: torch's ``get_cpu_capability()`` says "AVX512" with or without bf16 units."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:  # not Linux: no cheap way to know, and float32 is never a slow choice
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


@lru_cache(maxsize=8)
def _from_env(text: str) -> tuple[tuple[str, bool], ...]:
    answers = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, value = item.partition("=")
        if name.strip() not in NAMES or value.strip() not in ("0", "1"):
            raise ValueError(f"$MOGA_ASSUME={text!r}: expected comma-separated name=0 or name=1 with names from "
                             f"{', '.join(NAMES)} (e.g. bf16_matmul=1,compiler=0)")
        answers.append((name.strip(), value.strip() == "1"))
    return tuple(answers)
