"""The sharded steps on a fake CUDA mesh: torch's fake process group (a stub whose collectives do nothing)
with world size 2, traced as rank 0 and as rank 1, records the device of every tensor passed to a
collective: every one must be on the mesh's device (NCCL takes nothing else). DTensor parameters sharded
as FSDP2 shards them, user placements, CPU-offloaded shards on a CUDA mesh, and DDP's replicated Muon."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.testing._internal.distributed.fake_pg import FakeStore

from moga.optim import MOGA, Muon

from ..fake_cuda import fake_cuda, trace

WORLD = 2
SHAPES = [(8, 6), (6, 8), (4, 4)]


@pytest.fixture(params=range(WORLD), ids=lambda r: f"rank{r}")
def mesh(request):
    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=WORLD)
    try:
        yield DeviceMesh("cuda", torch.arange(WORLD))
    finally:
        dist.destroy_process_group()


def shard(local: torch.Tensor, mesh, placement, shape) -> DTensor:
    """A DTensor as FSDP2 builds one: its local tensor stays where it is (a CPU-offloaded shard on a CUDA
    mesh stays on the CPU; ``DTensor.from_local`` would move it to the mesh's device)."""
    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), local.dtype)
    return _from_local_no_grad(local, DTensorSpec(mesh, (placement,), tensor_meta=meta))


def sharded_params(mesh, placement, device: str, shapes=SHAPES) -> list[nn.Parameter]:
    """This rank's shards (on ``device``: "cpu" is FSDP2's CPU offload) of matrices of ``shapes``, with
    gradients."""
    params = []
    for shape in shapes:
        local = list(shape)
        local[placement.dim] //= WORLD
        p = nn.Parameter(shard(torch.empty(local, device=device), mesh, placement, shape))
        p.grad = shard(torch.empty(local, device=device), mesh, placement, shape)
        params.append(p)
    return params


STEPS = {
    "muon": lambda ps, **kw: Muon(ps, **kw),
    "muon-one-matrix": lambda ps, **kw: Muon(ps[:1], **kw),  # one rank owns no matrix of the bucket
    "moga-row": lambda ps, **kw: MOGA(ps, geometry="row(p=2)", **kw),
    "moga-col": lambda ps, **kw: MOGA(ps, geometry="col(q=2)", **kw),
}


def traced(make, params, steps: int = 2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warnings of the fake device are not the point here
        opt = make(params)
        for _ in range(steps - 1):
            opt.step()
        return trace(opt.step)


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=["shard0", "shard1"])
@pytest.mark.parametrize("name", list(STEPS))
def test_sharded_steps_on_the_device_pass_only_device_tensors(mesh, name, placement):
    with fake_cuda():
        step = traced(STEPS[name], sharded_params(mesh, placement, "cuda"))
    assert step.collectives and all(devices == {"cuda"} for _, devices in step.collectives), step.collectives
    assert step.syncs == [] and step.host_to_device == [] and step.mixed == []


@pytest.mark.parametrize("name", list(STEPS))
def test_offloaded_shards_meet_the_mesh_on_its_device(mesh, name):
    """FSDP2's CPUOffloadPolicy: shards and gradients on the CPU, the mesh (and NCCL) on CUDA. The step runs
    on the CPU; what goes to a collective is copied to the mesh's device first. The plain path: the C++
    kernel's own ops have no fake kernels (its split step reduces through the same ``reduce_over``)."""
    with fake_cuda():
        step = traced(lambda ps: STEPS[name](ps, kernel="torch"), sharded_params(mesh, Shard(0), "cpu"))
    assert step.collectives and all(devices == {"cuda"} for _, devices in step.collectives), step.collectives
    assert step.mixed == []


def test_ddp_muon_shares_updates_on_the_device(mesh):
    """Replicated CUDA matrices (DDP): each rank orthogonalizes its share, one all-gather on the device."""
    with fake_cuda():
        params = [nn.Parameter(torch.empty(s, device="cuda")) for s in SHAPES]
        for p in params:
            p.grad = torch.empty_like(p)
        step = traced(lambda ps: Muon(ps, distributed=True), params)
    assert [name for name, _ in step.collectives] == ["_allgather_base_"]
    assert all(devices == {"cuda"} for _, devices in step.collectives)
    assert step.syncs == [] and step.host_to_device == [] and step.mixed == []
