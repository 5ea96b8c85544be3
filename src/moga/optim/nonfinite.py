"""The non-finite gate: a step whose gradients hold NaN or inf, or whose lr is not finite, changes nothing.

The verdict is a 0-d bool on the device (a :class:`Gate`; None under ``nonfinite="ignore"``), never read on
the host unless ``nonfinite="raise"``: moga's kernels take it as ``skip`` and return untouched, the plain path's
numbers are gated on ``ok`` (:func:`gate`, :func:`finite`, :func:`ema_`), so a skipped step leaves weights and
state bit for bit as they were without a sync.
"""

from __future__ import annotations

import math
import warnings

import torch

from moga.kernels import DTYPES as KERNEL_DTYPES
from moga.kernels import all_finite, fused_ready, plain_tensor
from moga.optim import sharded
from moga.optim.precision import dense, same_memory_order
from moga.optim.sharded import local

POLICIES = ("skip", "raise", "ignore")  # the ``nonfinite`` option of every optimizer and of training configs


def check_policy(nonfinite: str) -> str:
    if nonfinite not in POLICIES:
        raise ValueError(f"nonfinite must be one of {POLICIES}, got {nonfinite!r}")
    return nonfinite


def gate(ok: torch.Tensor | None, value: float, skipped: float):
    """``value``, or on the device ``value`` where ``ok`` else ``skipped``: in float64, so that a gated step
    size is the very number the ungated one would be (no host sync, no host-to-device copy)."""
    if ok is None:
        return value
    on = ok.to(torch.float64)
    return on * value + (1 - on) * skipped


def finite(d: torch.Tensor, ok: torch.Tensor | None) -> torch.Tensor:
    """``d`` in place, zeroed on a skipped step (whose NaN would otherwise pass through a zero step size)."""
    return d if ok is None else torch.where(ok, d, d.new_zeros(()), out=d)


def ema_(bufs: list[torch.Tensor], grads: list[torch.Tensor], weight: float, ok: torch.Tensor | None) -> None:
    """``bufs <- bufs + weight * (grads - bufs)``, untouched (bit for bit) on a skipped step."""
    if ok is None:
        torch._foreach_lerp_(bufs, grads, weight)
    elif fused_sgd_applies(bufs, grads):
        # torch's fused SGD kernel steps W <- W - lr * (g + wd * W). With lr = -weight and wd = -1 that is
        # W + weight * (g - W), this EMA (the same bits as lerp for weights below 1/2), and found_inf makes it
        # return before touching anything: no pass to clean NaN out of the gradients.
        torch._fused_sgd_(bufs, grads, [], weight_decay=-1.0, momentum=0.0, lr=-weight, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False, grad_scale=None,
                          found_inf=(~ok).to(torch.float32))
    else:
        w = gate(ok, weight, 0.0)
        for b, g in zip(bufs, grads):
            b.lerp_(torch.where(ok, g, 0.0), w.to(b.dtype))


def fused_sgd_applies(bufs: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
    if not hasattr(torch, "_fused_sgd_") or torch.compiler.is_compiling():  # no fake kernel: compile can't trace it
        return False
    device, dtype = bufs[0].device, bufs[0].dtype
    return device.type in ("cpu", "cuda") and all(
        t.device == device and t.dtype == dtype and plain_tensor(t) for t in (*bufs, *grads)
    ) and same_memory_order(bufs, grads)


def lr_finite(work, policy: str) -> bool:
    """A non-finite lr is known on the host: False (the step is skipped) or, under "raise", an error, without
    touching the device. ``work`` holds (group index, plan, group, params) of the groups with gradients."""
    bad = []
    for gi, plan, group, _ in work:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):  # a tensor lr is read once per step (a sync off the CPU)
            group["lr"] = lr = float(lr)
        if not math.isfinite(lr):
            bad.append(f"group {gi} ({group.get('role', plan.geometry)}) lr={lr}")
    if not bad:
        return True
    message = f"non-finite learning rate in {', '.join(bad)}"
    if policy == "raise":
        raise FloatingPointError(message + "; weights and optimizer state are unchanged")
    warnings.warn(message + "; step skipped (see skipped_steps)", RuntimeWarning, stacklevel=3)
    return False


def flag_skip(work, found_inf: torch.Tensor, policy: str) -> torch.Tensor:
    """The caller's verdict as the step's 0-d bool ``skip`` on the gradients' device, in at most one op (none
    for a 0-d bool flag already there, as ``moga train`` passes): no pass over the gradients. Every op here
    runs once a step on caches the backward pass (or the last step) left cold, a few tens of microseconds each
    on a CPU after a step over GPT-2-small's matrices."""
    if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1:
        raise TypeError(f"found_inf must be a tensor with one element (nonzero: skip the step), got {found_inf!r}")
    device = local(work[0][3][0].grad).device
    flag = found_inf if found_inf.dim() == 0 else found_inf.reshape(())
    flag = flag.to(device, non_blocking=True)
    skip = flag if flag.dtype == torch.bool else flag != 0
    if policy == "raise" and bool(skip):  # the documented sync
        raise FloatingPointError("non-finite gradients (found_inf is set); weights and optimizer state are "
                                 "unchanged")
    return skip


class Gate:
    """The step's verdict on the device, in the forms its consumers take, each made at most once a step:
    ``skip`` (0-d bool, True: leave everything untouched) for moga's kernels and the skip counter, ``ok`` (its
    negation) for the plain path's gating, ``found`` (float32 1.0 or 0.0) for torch's fused kernels, which
    skip on exactly 1.0. A step that runs only moga's kernels makes none but ``skip``."""

    def __init__(self, skip: torch.Tensor, ok: torch.Tensor | None = None):
        self.skip, self._ok, self._found = skip, ok, None

    @property
    def ok(self) -> torch.Tensor:
        if self._ok is None:
            self._ok = ~self.skip
        return self._ok

    @property
    def found(self) -> torch.Tensor:
        if self._found is None:
            self._found = self.skip.to(torch.float32)
        return self._found


def gradients_ok(work, policy: str, kernel: str) -> torch.Tensor | None:
    """A 0-d bool on the device: every gradient is finite. None when ``policy`` is "ignore"."""
    if policy == "ignore":
        return None
    grads = [p.grad for *_, params in work for p in params]
    device = local(grads[0]).device
    shards = [local(g) for g in grads]
    plain = all(plain_tensor(g) for g in shards)
    if plain and kernel != "torch" and fused_ready(device) and all(g.dtype in KERNEL_DTYPES for g in shards):
        ok = all_finite(shards)  # one exact read-only pass in C++ (x * 0 is NaN only for NaN and inf)
    else:
        ok = all_finite_foreach([g for g in shards if g.numel()], device)  # an uneven split can leave none
    # Shards of one tensor live on several ranks: AND the flag so every rank skips alike (on the device).
    ok = sharded.all_ranks(grads, ok)
    if policy == "raise" and not bool(ok):  # the documented sync
        bad = [
            group["names"][k] if "names" in group else f"group {gi} param {k}"
            for gi, _, group, _ in work for k, p in enumerate(group["params"])
            if p.grad is not None and p.numel() and not bool(torch.isfinite(local(p.grad)).all())
        ]
        raise FloatingPointError(f"non-finite gradient in {len(bad)} tensor(s): {', '.join(bad[:5])}; "
                                 "weights and optimizer state are unchanged")
    return ok


_CUDA_AMP = (torch.float16, torch.float32, torch.float64)  # torch's CUDA check has no bfloat16 (seen on an H200)


def all_finite_foreach(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-d bool on ``device``: no element is NaN or inf. torch's AMP check, one launch per device and dtype
    (it multiplies by exactly 1, so values stay bit for bit); tensors it cannot take (another device type,
    overlapping memory) by their min and max, where NaN and inf show up and nothing overflows."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    batches: dict = {}
    others = []
    for t in tensors:
        if t.device == device and dense(t) and (device.type == "cpu" or device.type == "cuda" and t.dtype in _CUDA_AMP):
            batches.setdefault(t.dtype, []).append(t)
        else:
            others.append(t)
    if batches:
        one = torch.ones((), dtype=torch.float32, device=device)
        for batch in batches.values():
            torch._amp_foreach_non_finite_check_and_unscale_(batch, found, one)
    ok = found == 0
    if others:
        extremes = torch.cat([torch.stack(torch.aminmax(t)).to(device=device, dtype=torch.float64) for t in others])
        ok &= extremes.isfinite().all()
    return ok
