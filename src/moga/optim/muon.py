"""Muon as steepest descent in the (2,mean)->(2,mean) geometry (docs/math.md §2.4, §3.4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moga.geometry import Embedding, Spectral
from moga.optim.base import GeometryOptimizer
from moga.optim.options import SharedOptions, shared
from moga.orthogonalize import DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS
from moga.roles import role_geometries

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+; annotations are not evaluated at run time
    from typing_extensions import Unpack


class Muon(GeometryOptimizer):
    """Every matrix takes ``-s(m,n) U V^T`` of its Nesterov momentum, from a Newton-Schulz iteration.

    ``scale="mean"`` is the geometry's ``s = sqrt(fan_out/fan_in)``; ``scale="torch"`` is
    torch.optim.Muon's ``sqrt(max(1, fan_out/fan_in))``, with which this matches torch.optim.Muon step for
    step (given ``ns_dtype="bfloat16"``, the dtype torch uses). ``ns_dtype="auto"`` is bfloat16 where the hardware multiplies it fast (GPUs, CPUs with AMX or AVX512-BF16),
    else float32. Same-shape matrices share one batched Newton-Schulz call.
    Embeddings and vectors get MOGA's geometries, so Muon and MOGA differ only on the matrices.

    Sharded (FSDP2) matrices are split among the ranks of their shard group: each rank gathers and
    orthogonalizes its share and sends the slices back. Plain matrices are split the same way when
    ``distributed`` is on (``None``: when torch.distributed is initialized with world size > 1), and one
    all-gather shares the results: that assumes they are replicated, as under DDP. Pass
    ``distributed=False`` when ranks train different models.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        *,
        scale: str = "mean",
        ns_steps: int = DEFAULT_NS_STEPS,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        ns_dtype: str = "auto",
        method: str = "newton_schulz",
        embedding_q: float = 2.0,
        vectors: str = "adamw",
        **options: Unpack[SharedOptions],
    ):
        """``options``: the keywords every geometry optimizer shares (:class:`~moga.optim.options.SharedOptions`)."""
        spectral = Spectral(method=method, steps=ns_steps, coefficients=ns_coefficients, dtype=ns_dtype, scale=scale)
        self.role_geometries = role_geometries(spectral, Embedding(embedding_q), vectors)
        super().__init__(params, lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         geometry=spectral, **shared(type(self), options))
