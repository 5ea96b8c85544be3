"""How a model runs over processes and in which precision: ``train.parallel`` and ``train.precision``.

- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on every block of ``model.blocks`` (the GPT's
  transformer blocks, the ResidualMLP's residual blocks, the ResNet's basic blocks), then on the root,
  which takes the rest (embeddings, stem, head). Parameters, gradients and optimizer state become
  ``DTensor`` shards (``Shard(0)``); each block's weights are gathered for its forward and backward only.
- ``ddp``: DistributedDataParallel (the engine wraps the model; see :mod:`moga.train.distributed`).
- ``bf16``: the forward runs under ``torch.autocast(bfloat16)`` on CPU and CUDA (matmuls in bfloat16;
  softmax, norms and the loss in float32). Under fsdp, FSDP2 also casts the gathered weights to bfloat16
  and reduces gradients in float32 (``MixedPrecisionPolicy``); the optimizer always sees float32 weights.
- ``offload`` (fsdp only): the shards of parameters, gradients and optimizer state stay in CPU memory
  (``CPUOffloadPolicy``); each block's weights go to the device for its forward and backward, and the
  optimizer steps on the CPU, where moga's fused C++ kernel takes every shard whose step is local.

Measured on ``configs/train/shakespeare_char_gpt.yaml`` (4 blocks of 128, MOGA, batch 32 x 64 tokens, CPU,
torch 2.13): 60 steps in bf16 end within 1e-4 relative of fp32 in every 10-step mean training loss
(final_train_loss 6.6e-5, val_loss 1.9e-5). On a CPU without AVX512-BF16 or AMX, bf16 matmuls are
emulated and ran 8-12x slower than fp32; bf16 pays off on GPUs and bf16-capable CPUs. fsdp on 2
processes matched one process to 1e-8 relative in the loss over 30 steps.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one before the root: the model's blocks, when it has them."""
    blocks = getattr(model, "blocks", None)
    return list(blocks) if isinstance(blocks, (nn.ModuleList, nn.Sequential)) else []


def shard_model(model: nn.Module, precision: str = "fp32", offload: bool = False) -> nn.Module:
    """``fully_shard`` each block, then the root, over all processes (a 1-D mesh); returns the model.
    ``offload`` keeps the shards in CPU memory between uses (``CPUOffloadPolicy``, pinned where CUDA is)."""
    # here, not at the top: torch.distributed.fsdp pulls in DTensor and sympy, a third of a second for every
    # command that imports the trainer and shards nothing
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dtype = PRECISIONS[precision]
    kwargs = dict(mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None),
                  offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy())
    for unit in shard_units(model):
        if any(True for _ in unit.parameters()):
            fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def autocast(precision: str, device: torch.device):
    """The forward's precision context: bf16 autocast, or nothing for fp32."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def is_sharded(model: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported yet: nothing can have been sharded
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def gradient_sync(model: nn.Module, last_micro_batch: bool):
    """Reduce gradients on the last micro-batch only (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(last_micro_batch)
        return contextlib.nullcontext()
    if isinstance(model, nn.parallel.DistributedDataParallel) and not last_micro_batch:
        return model.no_sync()
    return contextlib.nullcontext()
