"""The process group the trainer joins."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from moga.train.distributed import group_backend


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_group_takes_cpu_tensors_on_every_device(device):
    """Offloaded shards on GPUs clip gradients with a CPU all-reduce: an NCCL-only group refuses it."""
    backends = BackendConfig(dist.Backend(group_backend(torch.device(device)))).get_device_backend_map()
    assert backends["cpu"] == "gloo"
    assert backends["cuda"] == ("nccl" if device == "cuda" else "gloo")
