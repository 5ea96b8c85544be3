"""Whole-matrix steps (spectral, Muon's geometry): the ones that need every entry of a matrix at once.

:func:`split` sorts a param group's tensors before the step: the local ones go through
:func:`moga.optim.functional.lmo_step_` one by one; the rest step here. Several same-shape matrices on one
process go through one batched Newton-Schulz call (:func:`steps_`, a transformer's identical matrices cost one
call, not one each); on FSDP2 shards, and on DDP replicas when the optimizer is ``distributed``, the matrices
are split among the ranks (:func:`step_jobs`): on shards one all-to-all sends each matrix's shards to its
owner, which orthogonalizes it, and a second sends the update's slices back (as in microsoft/dion), so each
matrix crosses the network once per step in total, whatever the number of ranks; on replicas each rank
computes its share and one all-gather shares the updates (ZeRO-1 style).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moga.layout import Layout, as_layout
from moga.optim.functional import average_, gated_direction
from moga.optim.nonfinite import gate
from moga.optim.sharded import is_dtensor, needs_whole, sharded_dims
from moga.workspace import Workspace


def split(geometry, layouts: list, params: list[torch.Tensor], split_replicated: bool) -> tuple[list, list]:
    """(indices of the local steps, of the whole-matrix ones here): a lone plain matrix steps locally, as do
    plain matrices beside shards, those of a geometry that promises per-matrix numbers (``batched`` False) and
    those of a stateful one (each matrix with its own state; refused on shards and split replicas)."""
    batched = (len(params) > 1 and geometry.batched and not geometry.stateful and not split_replicated
               and not any(is_dtensor(p) for p in params))
    whole = [k for k, (p, layout) in enumerate(zip(params, layouts)) if needs_whole(geometry, layout)
             and (batched or is_dtensor(p) or split_replicated)]
    chosen = set(whole)
    return [k for k in range(len(params)) if k not in chosen], whole


def steps_(geometry, layouts: list, params: list[torch.Tensor], targets: list[torch.Tensor],
           grads: list[torch.Tensor], bufs: list[torch.Tensor] | None, *, lr: float, momentum: float,
           nesterov: bool, weight_decay: float, ok: torch.Tensor | None, workspace: Workspace | None,
           split_replicated: bool) -> list[WholeJob]:
    """The step of :func:`moga.optim.functional.lmo_step_` on whole matrices: same-shape plain ones batched
    here, the others returned as jobs for :func:`step_jobs` to split among ranks after every group's step."""
    ms = average_(targets, grads, bufs, lr=lr, momentum=momentum, weight_decay=weight_decay, ok=ok)
    alpha = gate(ok, lr, 0.0)  # 0 on a skipped step: every geometry maps a finite direction to a no-op
    directions = [gated_direction(g, None if ms is None else ms[k], momentum, nesterov, ok)
                  for k, g in enumerate(grads)]  # their own memory: the jobs keep them
    if split_replicated or any(is_dtensor(p) for p in params):
        return [WholeJob(p, t, d, geometry, layout, alpha) for p, t, d, layout in zip(params, targets, directions, layouts)]
    batches: dict[tuple, list[int]] = {}  # the stack is a batch axis ``b`` of the layout
    for k, (t, layout) in enumerate(zip(targets, layouts)):
        batches.setdefault((t.shape, t.dtype, t.device, layout), []).append(k)
    for (_, _, _, layout), ks in batches.items():
        weights = torch.stack([targets[k] for k in ks])
        geometry.apply_lmo_(weights, torch.stack([directions[k] for k in ks]), alpha, as_layout("b" + layout.spec),
                            workspace)
        torch._foreach_copy_([targets[k] for k in ks], list(weights.unbind(0)))
    return []


@dataclass
class WholeJob:
    """One parameter whose update needs the whole matrix: ``target += lr * lmo(direction)``."""

    param: torch.Tensor  # DTensor or plain: its global shape and placements
    target: torch.Tensor  # the local tensor the update goes to (the parameter's shard, or its master copy)
    direction: torch.Tensor  # local, like target
    geometry: object
    layout: Layout
    lr: float | torch.Tensor  # a 0-d tensor when the step may be skipped on the device

    @property
    def cost(self) -> float:
        m, n = self.layout.fan_out(self.param.shape), self.layout.fan_in(self.param.shape)
        b = self.param.numel() // max(1, m * n)
        return b * m * n * min(m, n)


def owners(jobs: list[WholeJob], world: int) -> list[int]:
    """Greedy balance of Newton-Schulz cost: largest first onto the least loaded rank. Depends only on
    shapes and order, so every rank computes the same assignment."""
    load = [0.0] * world
    owner = [0] * len(jobs)
    for k in sorted(range(len(jobs)), key=lambda k: (-jobs[k].cost, k)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[k], load[r] = r, load[r] + jobs[k].cost
    return owner


def _full_update(job: WholeJob, full_direction: torch.Tensor) -> torch.Tensor:
    upd = torch.zeros_like(full_direction)
    lr = job.lr.to(upd.device) if isinstance(job.lr, torch.Tensor) else job.lr  # offloaded: from the CPU
    job.geometry.apply_lmo_(upd, full_direction, lr, job.layout)
    return upd


def _chunks(size: int, world: int) -> list[int]:
    """Sizes of torch.chunk(size, world) padded to world entries: DTensor's Shard split."""
    c = -(-size // world)
    return [max(0, min(c, size - k * c)) for k in range(world)]


def _shard_shapes(shape, dim: int, world: int) -> list[tuple[int, ...]]:
    return [tuple(s if d != dim else n for d, s in enumerate(shape)) for n in _chunks(shape[dim], world)]


def step_jobs(jobs: list[WholeJob]) -> None:
    """Whole-matrix steps: DTensors within their shard groups, plain tensors (replicated) across the world."""
    step_whole_sharded([j for j in jobs if is_dtensor(j.param)])
    step_whole_replicated([j for j in jobs if not is_dtensor(j.param)])


def step_whole_sharded(jobs: list[WholeJob]) -> None:
    """Spectral steps on DTensors sharded along one mesh dim: two all-to-alls per (mesh group, dtype)."""
    if not jobs:
        return
    buckets: dict[tuple, tuple] = {}
    for job in jobs:
        shards = sharded_dims(job.param)
        if not shards:  # replicated on its mesh: every rank holds it whole
            job.target.add_(_full_update(job, job.direction))
            continue
        (dim, (mesh_dim,)), = shards.items()
        mesh = job.param.device_mesh
        key = (mesh, mesh_dim, dim, job.direction.dtype)  # equal meshes built by separate calls: one bucket
        buckets.setdefault(key, (mesh.get_group(mesh_dim), []))[1].append(job)
    for (mesh, _, dim, dtype), (group, bucket) in buckets.items():
        _exchange(bucket, group, dim, dtype, mesh.device_type)


def _exchange(jobs: list[WholeJob], group, dim: int, dtype, device: str) -> None:
    """The two all-to-alls on the mesh's ``device`` (NCCL takes device tensors only): CPU-offloaded shards
    go there and their updates come back; the owners orthogonalize there."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    owner = owners(jobs, world)
    shapes = [_shard_shapes(tuple(j.param.shape), dim, world) for j in jobs]
    numel = lambda s: math.prod(s)  # noqa: E731
    mine = [k for k in range(len(jobs)) if owner[k] == me]
    # 1. every rank sends its shard of matrix k to owner[k]
    send = [jobs[k].direction.reshape(-1) for r in range(world) for k in range(len(jobs)) if owner[k] == r]
    in_splits = [sum(numel(shapes[k][me]) for k in range(len(jobs)) if owner[k] == r) for r in range(world)]
    out_splits = [sum(numel(shapes[k][s]) for k in mine) for s in range(world)]
    recv = _all_to_all(send, in_splits, out_splits, dtype, group, device)
    pieces: dict[int, list[torch.Tensor]] = {k: [] for k in mine}
    offset = 0
    for s in range(world):
        for k in mine:
            n = numel(shapes[k][s])
            pieces[k].append(recv[offset: offset + n].view(shapes[k][s]))
            offset += n
    # 2. owners compute whole updates and send each rank its slice
    updates = {k: _full_update(jobs[k], torch.cat(pieces[k], dim=dim)) for k in mine}
    send = [u.contiguous().reshape(-1) for s in range(world) for k in mine
            for u in (_slice(updates[k], dim, world, s),)]
    back = _all_to_all(send, out_splits, in_splits, dtype, group, device)
    offset = 0
    for r in range(world):
        for k in range(len(jobs)):
            if owner[k] == r:
                n = numel(shapes[k][me])
                target = jobs[k].target
                target.add_(back[offset: offset + n].view(shapes[k][me]).to(target.device))
                offset += n


def _slice(t: torch.Tensor, dim: int, world: int, s: int) -> torch.Tensor:
    sizes = _chunks(t.shape[dim], world)
    return t.narrow(dim, sum(sizes[:s]), sizes[s])


def _all_to_all(send: list[torch.Tensor], in_splits, out_splits, dtype, group, device: str) -> torch.Tensor:
    """On ``device``, also for a rank that sends nothing (it still takes part)."""
    flat = torch.cat(send).to(device=device, dtype=dtype) if send else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(out_splits), dtype=dtype, device=flat.device)
    dist.all_to_all_single(out, flat, out_splits, in_splits, group=group)
    return out


def step_whole_replicated(jobs: list[WholeJob], group=None) -> None:
    """Spectral steps on replicated plain tensors (DDP): each rank computes its share, one all-gather."""
    if not jobs:
        return
    world, me = dist.get_world_size(group), dist.get_rank(group)
    by_dtype: dict[torch.dtype, list[WholeJob]] = {}
    for job in jobs:
        by_dtype.setdefault(job.direction.dtype, []).append(job)
    for dtype, bucket in by_dtype.items():
        owner = owners(bucket, world)
        sizes = [sum(bucket[k].param.numel() for k in range(len(bucket)) if owner[k] == r) for r in range(world)]
        width = max(sizes)
        device = bucket[0].param.device
        mine = torch.zeros(width, dtype=dtype, device=device)
        offset = 0
        for k, job in enumerate(bucket):
            if owner[k] == me:
                n = job.param.numel()
                mine[offset: offset + n] = _full_update(job, job.direction).reshape(-1)
                offset += n
        everything = torch.empty(world * width, dtype=dtype, device=device)
        dist.all_gather_into_tensor(everything, mine, group=group)
        offsets = [r * width for r in range(world)]
        for k, job in enumerate(bucket):
            n = job.param.numel()
            job.target.add_(everything[offsets[owner[k]]: offsets[owner[k]] + n].view(job.param.shape))
            offsets[owner[k]] += n
