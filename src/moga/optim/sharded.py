"""Steps on sharded parameters (FSDP2's ``DTensor``) and replicated ones (DDP), with as little traffic as the math allows.

Each geometry reduces over some axes of its logical matrix (row: fan_in, col and embedding: fan_out, sign
and vector: none, spectral: the whole matrix). On a ``DTensor`` parameter every rank works on its local shard:

- **local**: no sharded tensor dim is reduced over (a Linear ``oi`` or an Embedding ``io`` sharded on dim 0
  under row, sign, embedding, vector). No collective at all, and the fused kernel of :mod:`moga.kernels`
  steps the local shards as it steps plain tensors (FSDP2's ``CPUOffloadPolicy`` runs it on the CPU).
- **reduce**: a reduced dim is sharded (col on a row-sharded Linear, a user's ``Shard(1)`` under row). The
  geometry's per-row or per-column partial sums are all-reduced over the mesh dims that shard it, never the
  matrix: on CPU shards the fused kernel's sums and maxima, one all-reduce each per param group
  (:func:`moga.kernels.fused_split_step_`); on the plain path one small all-reduce per matrix.
- **gather** (spectral): the matrices are split among the ranks of the shard group; one all-to-all sends each
  matrix's shards to its owner, which orthogonalizes it, and a second sends the update's slices back (as in
  microsoft/dion). Each matrix crosses the network once per step in total, whatever the number of ranks.

Plain tensors under DDP are identical on every rank; there a spectral step is split the same way and one
all-gather shares the updates (ZeRO-1 style). Geometry factors (``1/fan_in``, ``fan_out^(1/q)``) always use
the global shape: :class:`ShardLayout` carries it, so the geometries need not know about sharding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sys

import torch
import torch.distributed as dist

from moga.layout import Layout, ShardLayout

# torch.distributed.tensor (and sympy with it) costs about 2 s to import; a DTensor exists only once it is
# imported, so ``import moga`` leaves it alone and asks sys.modules.


def is_dtensor(t) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _placements():
    from torch.distributed.tensor import Replicate, Shard

    return Shard, Replicate


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a ``DTensor`` (an alias: in-place updates reach the parameter), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def needs_whole(geometry, layout: Layout | None) -> bool:
    """The geometry reduces over every axis of its matrix (spectral): its step needs the whole matrix."""
    if layout is None:
        return False
    return set(layout.out_dims + layout.in_dims) <= set(geometry.reduced_dims(layout))


class ShardingError(ValueError):
    """A placement the geometry cannot step on; the message names the parameter and the placement."""


def sharded_dims(p: torch.Tensor) -> dict[int, list[int]]:
    """tensor dim -> the mesh dims that shard it, for a DTensor; {} for a plain tensor."""
    if not is_dtensor(p):
        return {}
    Shard, _ = _placements()
    out: dict[int, list[int]] = {}
    for mesh_dim, pl in enumerate(p.placements):
        if type(pl) is Shard and p.device_mesh.size(mesh_dim) > 1:
            out.setdefault(pl.dim % p.ndim, []).append(mesh_dim)
    return out


def check_placements(name: str, p: torch.Tensor, geometry, layout: Layout | None) -> None:
    """Raise :class:`ShardingError` when ``geometry`` cannot step on ``p``'s placements."""
    if not is_dtensor(p):
        return
    Shard, Replicate = _placements()
    for pl in p.placements:
        if type(pl) not in (Shard, Replicate):
            raise ShardingError(
                f"{name}: placement {pl!r} in {p.placements} is not supported; parameters must be Shard(d) or "
                "Replicate() (a Partial or strided shard is not a parameter layout moga can step on)")
    shards = sharded_dims(p)
    if geometry.stateful and shards:
        raise ShardingError(
            f"{name}: {geometry} keeps a second moment per row, which the sharded whole-matrix step (one rank "
            f"orthogonalizes each matrix) does not carry; use {geometry.name} with beta2=0 (or spectral) on sharded "
            f"parameters, got placements {p.placements}")
    if needs_whole(geometry, layout) and (len(shards) > 1 or any(len(m) > 1 for m in shards.values())):
        raise ShardingError(
            f"{name}: {geometry} gathers whole matrices and supports one sharded mesh dim, got placements "
            f"{p.placements}")


def check_stateful_split(geometry, split_replicated: bool) -> None:
    """Replicated ranks that split whole-matrix steps (DDP) would each keep a stale copy of a stateful geometry's
    state (NorMuon's row second moment): refused."""
    if split_replicated and geometry.stateful:
        raise ShardingError(f"{geometry} keeps per-row state that one rank's share of the step cannot update on "
                            "every rank: pass distributed=False (each rank steps every matrix), or use beta2=0")


def check_grad(name, p: torch.Tensor) -> None:
    """A DTensor parameter's gradient must be sharded like it: the step pairs their local shards.
    ``name()`` gives the parameter's name for the error."""
    if is_dtensor(p) and (not is_dtensor(p.grad) or p.grad.placements != p.placements):
        got = p.grad.placements if is_dtensor(p.grad) else "a plain tensor"
        raise ShardingError(f"{name()}: parameter with placements {p.placements} has a gradient "
                            f"with placements {got}; redistribute the gradient like its parameter")


def global_layout(p: torch.Tensor, layout: Layout | None) -> Layout | None:
    """``layout`` for a DTensor's local shard, with fan_in/fan_out of the global tensor."""
    if layout is None or not is_dtensor(p):
        return layout
    return ShardLayout(layout.spec, tuple(p.shape))


def _reduced_mesh_dims(p: torch.Tensor, geometry, layout: Layout | None) -> list[int]:
    """The mesh dims that shard a dim ``geometry`` reduces over; [] when the local shard holds them whole."""
    if not is_dtensor(p) or layout is None:
        return []
    shards = sharded_dims(p)
    return sorted({m for d in geometry.reduced_dims(layout) for m in shards.get(d, ())})


def reduce_key(p: torch.Tensor, geometry, layout: Layout | None) -> tuple | None:
    """What ``p``'s partial sums are combined over: (mesh, mesh dims), equal for shards that can share one
    collective (equal meshes from separate ``fully_shard`` calls included); None when the step is local."""
    mesh_dims = _reduced_mesh_dims(p, geometry, layout)
    return (p.device_mesh, tuple(mesh_dims)) if mesh_dims else None


def reduce_over(key: tuple):
    """``reduce(partial, op)`` over the mesh dims of a :func:`reduce_key` (in place, returns it)."""
    mesh, mesh_dims = key
    groups = [mesh.get_group(m) for m in mesh_dims]

    def reduce(partial: torch.Tensor, op: str) -> torch.Tensor:
        rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        # CPU-offloaded shards on a CUDA mesh: NCCL reduces device tensors only
        t = partial if partial.device.type == mesh.device_type else partial.to(mesh.device_type)
        for g in groups:
            dist.all_reduce(t, op=rop, group=g)
        return partial if t is partial else partial.copy_(t)

    return reduce


def reducer(p: torch.Tensor, geometry, layout: Layout | None):
    """``reduce(partial, op)`` combining per-row/per-column partials over the ranks that shard the dims
    ``geometry`` reduces over (in place, returns it); None when those dims are whole on this rank."""
    key = reduce_key(p, geometry, layout)
    return None if key is None else reduce_over(key)


def all_ranks(params: list[torch.Tensor], flags: torch.Tensor) -> torch.Tensor:
    """AND of boolean ``flags`` over the ranks that hold different shards of these DTensors: an all-reduce MIN
    per mesh dim that shards one of them, on the device (no host sync). Along a ``Replicate()`` mesh dim (the
    replicas of HSDP, DDP) the gradients are equal, so the flags already agree there."""
    meshes: dict = {}  # equal meshes (each fully_shard call may build its own) count once
    for p in params:
        for mesh_dims in sharded_dims(p).values():
            meshes.setdefault(p.device_mesh, set()).update(mesh_dims)
    if not meshes:
        return flags
    t = None
    for mesh, mesh_dims in meshes.items():
        t = flags.to(device=mesh.device_type, dtype=torch.int32) if t is None else t.to(mesh.device_type)
        for m in sorted(mesh_dims):  # NCCL reduces device tensors only
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=mesh.get_group(m))
    return t.to(flags.device).bool()


# --- whole-matrix geometries: split the work among ranks -------------------------------------------------


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


def step_whole(jobs: list[WholeJob]) -> None:
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


def replicated_world(distributed: bool | None) -> bool:
    """Whether plain (replicated) parameters split whole-matrix work: ``None`` means when torch.distributed
    is initialized with more than one rank."""
    ready = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed and not ready:
        raise RuntimeError("distributed=True needs torch.distributed initialized with world size > 1")
    return ready if distributed is None else bool(distributed)
