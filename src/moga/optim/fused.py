"""The fused steps: one pass per tensor where a kernel takes the group, tested equal to
:mod:`moga.optim.functional`.

``lmo_group_`` hands row, col, sign and embedding groups to :mod:`moga.kernels` (C++ on CPU tensors and the
local shards of FSDP2 parameters, the compiled kernel on CUDA); ``adam_group_`` hands Adam groups to torch's
fused AdamW kernel. Each returns what it left to the plain path, or says up front that it cannot run.
A skipped step (``ok`` False) leaves everything untouched inside the kernel, without a host read.
"""

from __future__ import annotations

import torch

from moga.kernels import fused_lmo_step_, fused_split_step_
from moga.optim import sharded
from moga.optim.precision import low_precision, same_memory_order
from moga.optim.sharded import local


def lmo_group_(plan, group: dict, params: list[torch.Tensor], bufs: list[torch.Tensor] | None,
             skip: torch.Tensor | None, master_weights: bool) -> list[torch.Tensor]:
    """The fused kernel on the parameters it covers, plain tensors and the local shards of DTensors; ``bufs``
    are their momentum buffers (None without momentum), ``skip`` the step's 0-d verdict (set: touch nothing;
    None: no gate), which the kernels read as it is. Returns the parameters left to the plain path."""
    lr, momentum = group["lr"], group["momentum"]
    # Local steps (plain tensors, shards that hold whole rows or columns) in one call; shards whose rows
    # or columns are split over ranks (col on FSDP2's Shard(0)) per set of ranks that combine their sums.
    calls: dict = {}
    others = []
    for k, p in enumerate(params):
        key = sharded.reduce_key(p, plan.geometry, plan.layout(p))
        if (master_weights and low_precision(p)) or (key is not None and torch.compiler.is_compiling()):
            others.append(p)
        else:
            calls.setdefault(key, []).append(k)
    args = (lr, momentum, group["nesterov"], group["weight_decay"])
    for key, ks in calls.items():
        mine = [params[k] for k in ks]
        layouts = [plan.layout(p) for p in mine]  # a DTensor's has the global shape's factors (plan_group)
        tensors = (plan.geometry, layouts, [local(p) for p in mine], [local(p.grad) for p in mine],
                   None if bufs is None else [local(bufs[k]) for k in ks])
        if key is None:
            rest = fused_lmo_step_(*tensors, *args, skip)
        else:
            rest = fused_split_step_(*tensors, *args, sharded.reduce_over(key), skip)
        others += [mine[k] for k in rest]
    return others


def adam_applies(params: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 master_weights: bool) -> bool:
    """torch's fused AdamW kernel exists for these tensors: one CPU or CUDA device, one dtype for parameters,
    gradients and moments, one memory order. bfloat16 too (``state_dtype=torch.bfloat16``): the kernel does
    its math in float32, as the plain path does, but not with master copies, which it would bypass. Not under
    torch.compile, which cannot trace it on tensors it mutates functionally: there the plain path."""
    if not hasattr(torch, "_fused_adamw_") or torch.compiler.is_compiling():
        return False
    device, dtype = params[0].device, params[0].dtype
    allowed = (torch.float32, torch.float64) if master_weights else (torch.float32, torch.float64, torch.bfloat16)
    return (device.type in ("cpu", "cuda") and dtype in allowed
            and all(p.device == device and p.dtype == dtype and p.grad.dtype == dtype for p in params)
            and all(m.dtype == dtype for m in (*exp_avgs, *exp_avg_sqs))
            and same_memory_order([local(p) for p in params], [local(p.grad) for p in params], exp_avgs, exp_avg_sqs))


def adam_group_(plan, group: dict, params, exp_avgs, exp_avg_sqs, steps, found_inf: torch.Tensor | None) -> None:
    """torch's fused AdamW kernel, one call per sign factor c: lr*c, and decay wd/c so that the decay stays
    lr*wd. One pass over the tensors instead of about six; ``found_inf`` (float32 1.0: skip) makes a skipped
    step return before touching anything."""
    lr, wd = group["lr"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    by_scale: dict[float, list[list]] = {}
    for p, m, v, step in zip(params, exp_avgs, exp_avg_sqs, steps):
        lists = by_scale.setdefault(plan.sign_scale(p), [[], [], [], [], []])
        for bucket, t in zip(lists, (local(p), local(p.grad), m, v, step)):
            bucket.append(t)
    for c, (ps, gs, ms, vs, ss) in by_scale.items():
        torch._fused_adamw_(ps, gs, ms, vs, [], ss, amsgrad=False, lr=lr * c, beta1=beta1, beta2=beta2,
                            weight_decay=wd / c if wd else 0.0, eps=group["eps"], maximize=False,
                            grad_scale=None, found_inf=found_inf)
