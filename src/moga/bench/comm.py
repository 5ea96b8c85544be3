"""Count the collectives a block of code issues, and the bytes each rank hands to them.

``CommDebugMode`` counts collectives; this mode also records each one's payload: the tensors a rank
contributes (for an all-reduce the reduced tensor, for an all-to-all the data it sends, for an all-gather
its own part).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op -> index of the argument holding this rank's contribution
_PAYLOAD = {
    "allreduce_": 0, "allreduce_coalesced_": 0, "broadcast_": 0, "reduce_": 0,
    "alltoall_base_": 1, "alltoall_": 1, "_allgather_base_": 1, "allgather_": 1,
    "allgather_into_tensor_coalesced_": 1, "_reduce_scatter_base_": 1, "reduce_scatter_": 1,
    "reduce_scatter_tensor_coalesced_": 1, "gather_": 1, "scatter_": 1,
}


def _nbytes(x) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class CommLog(TorchDispatchMode):
    """``with CommLog() as log: opt.step()``; then ``log.calls`` is a list of (op name, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        if packet._qualified_op_name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::")):
            name = packet.__name__
            index = _PAYLOAD.get(name, 0)
            self.calls.append((name, _nbytes(args[index]) if len(args) > index else 0))
        return func(*args, **(kwargs or {}))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, _ in self.calls:
            out[name] = out.get(name, 0) + 1
        return out

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.calls)
