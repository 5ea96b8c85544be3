"""Which of the fused kernel's ops a step called: what ran, not what was meant to."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class FusedCalls(TorchDispatchMode):
    """``with FusedCalls() as calls: opt.step()``; then ``calls.ops`` lists the fused kernel's ops called,
    as ``(name, tensors)``, and ``calls.stepped`` counts the tensors the kernel stepped. Sees the C++ library
    and the public custom ops alike."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket._qualified_op_name
        if name.startswith(("moga_kernels::", "moga::")):
            self.ops.append((name, len(args[0])))
        return func(*args, **(kwargs or {}))

    @property
    def stepped(self) -> int:
        return sum(n for name, n in self.ops if name.endswith(("::lmo_step", "::lmo_step_", "::lmo_apply")))
