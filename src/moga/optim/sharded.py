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
- **gather** (spectral): the step needs whole matrices; :mod:`moga.optim.whole` splits them among the ranks
  (one all-to-all there, one back). Plain tensors under DDP are identical on every rank; there a spectral step is
  split the same way and one all-gather shares the updates.

Geometry factors (``1/fan_in``, ``fan_out^(1/q)``) always use the global shape: :class:`ShardLayout` carries it, so the geometries need not know about sharding.
"""

from __future__ import annotations

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


def replicated_world(distributed: bool | None) -> bool:
    """Whether plain (replicated) parameters split whole-matrix work: ``None`` means when torch.distributed
    is initialized with more than one rank."""
    ready = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed and not ready:
        raise RuntimeError("distributed=True needs torch.distributed initialized with world size > 1")
    return ready if distributed is None else bool(distributed)
