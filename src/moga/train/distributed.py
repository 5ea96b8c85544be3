"""Several processes through ``torchrun``: the process group from the environment, and reductions.

Every rank draws the same global batch and trains on its own slice of it, so a run on W
processes sees exactly the data a one-process run with the same batch size sees; gradients are
averaged by DistributedDataParallel or, with ``train.parallel=fsdp``, reduce-scattered by FSDP2
(:mod:`moga.train.parallel`). Only rank 0 writes files, except sharded checkpoints, which every rank
writes its part of. FSDP on one process still joins a (one-rank) process group, so its checkpoints
load on any number of processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # True when setup() created the process group (so teardown ends it)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def shard(self, n: int) -> slice:
        """This rank's slice of a global batch of n items."""
        if n % self.world:
            raise ValueError(f"a batch of {n} does not split over {self.world} processes")
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"train.device={name!r} is not a device: use auto, cpu, cuda or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name} but this torch ({torch.__version__}) sees no CUDA device: "
                         "use train.device=auto or cpu")
    if device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError("train.device=mps but MPS is not available here: use train.device=auto or cpu")
    return torch.device("cuda", local_rank) if name == "cuda" else device


def group_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, with gloo beside it for CPU ones: CPU-offloaded shards (train.offload) meet
    in CPU collectives too, such as gradient clipping's total norm."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def setup(device: str = "auto", parallel: str = "auto") -> Dist:
    """Join the process group torchrun describes (WORLD_SIZE > 1), or run alone.

    ``parallel="fsdp"`` on one process makes a one-rank group (FSDP2 and sharded checkpoints need one);
    ``parallel="none"`` refuses several processes, which would each train alone on a slice of the batch.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    dev = pick_device(device, local_rank)
    if dist.is_initialized():
        world = dist.get_world_size()
    if parallel == "none" and world > 1:
        raise RuntimeError(f"train.parallel=none trains in one process, but {world} were launched: "
                           "set train.parallel=ddp or fsdp, or launch one process")
    if world <= 1 and parallel != "fsdp":
        return Dist(device=dev)
    owns = False
    if not dist.is_initialized():
        backend = group_backend(dev)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if world <= 1:  # one process: a group in memory, no rendezvous
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend=backend)
        owns = True
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dev, owns)


def teardown(d: Dist, clean: bool = True) -> None:
    """Leave the group this run made. After a clean run every rank waits for the others first: a rank that
    closes its connections while another still uses them makes gloo abort (SIGABRT, "terminate called
    without an active exception"), failing a finished run. After an error no rank waits (the others may
    never arrive)."""
    if d.owns_group and dist.is_initialized():
        if clean and d.world > 1:
            dist.barrier()
        dist.destroy_process_group()


def all_sum(d: Dist, values: list[float]) -> list[float]:
    """Sums over ranks, in float64 (so counts and loss sums stay exact enough)."""
    if not d.active:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=d.device if d.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def gather_objects(d: Dist, obj) -> list:
    """A list with every rank's obj (on every rank): the engine saves every rank's RNG state."""
    if not d.active:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def barrier(d: Dist) -> None:
    if d.active:
        dist.barrier()
