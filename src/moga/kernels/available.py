"""Whether the fused kernel can run for a device: ``kernel="cpp"`` raises when it cannot, ``"auto"`` warns
once per device type and takes the plain path, ``"torch"`` never asks."""

from __future__ import annotations

import warnings

import torch

from moga.hardware import facts
from moga.kernels.build import load_extension

KERNELS = ("auto", "cpp", "torch")

_unavailable: dict[str, str] = {}  # device type -> why the fused kernel cannot run there ("" = it can)


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def _why_unavailable(device_type: str) -> str | None:
    missing = _missing_tool(device_type)
    if missing:  # not cached: tests set hardware facts either way
        return missing
    if device_type not in _unavailable:
        try:
            if device_type == "cpu":
                load_extension()
            elif device_type != "cuda":  # CUDA steps in the plain reference through the op: nothing to load
                raise RuntimeError(f"no fused kernel for {device_type} tensors")
            _unavailable[device_type] = ""
        except Exception as e:  # no compiler, a failed build: both mean "use the plain path"
            _unavailable[device_type] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return _unavailable[device_type] or None


def _missing_tool(device_type: str) -> str | None:
    have = facts()
    if device_type == "cpu" and not have.compiler:
        return "no C++ compiler: install g++ or set $CXX"
    return None


def fused_available(kernel: str, device: torch.device) -> bool:
    """Whether the fused kernel runs for tensors on ``device`` under ``kernel``. ``"cpp"`` raises when it
    cannot; ``"auto"`` warns once per device type and returns False."""
    if kernel == "torch":
        return False
    why = _why_unavailable(device.type)
    if why is None:
        return True
    if kernel == "cpp":
        raise RuntimeError(f"kernel='cpp': the fused kernel is not available for {device.type} tensors ({why})")
    if device.type in ("cpu", "cuda") and not getattr(fused_available, f"_warned_{device.type}", False):
        setattr(fused_available, f"_warned_{device.type}", True)
        warnings.warn(f"moga: fused {device.type} kernel unavailable ({why}); using the plain torch path", RuntimeWarning,
                      stacklevel=3)
    return False


def fused_ready(device: torch.device) -> bool:
    """The fused kernel is already built and loaded for this device (never starts a build)."""
    return _unavailable.get(device.type) == "" and device.type == "cpu" and not _missing_tool("cpu")
