"""The width paper's rescaled AdamW: Adam's direction in the sign geometry, so lr/fan_in on matrices."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moga.geometry import INF, Embedding, Sign
from moga.optim.base import GeometryOptimizer
from moga.optim.options import SHARED_DEFAULTS, SharedOptions, shared
from moga.roles import role_geometries

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+; annotations are not evaluated at run time
    from typing_extensions import Unpack


class ScaledAdamW(GeometryOptimizer):
    """AdamW whose step on hidden and readout matrices is ``lr/fan_in * m_hat/(sqrt(v_hat)+eps)``.

    This is the ``(1,mean)->inf`` (sign) geometry with Adam's direction in place of ``sign(G)``; on
    embeddings (``1->inf``, ``embedding(q=inf)``) and vectors it has no factor. It equals muP's Adam
    (hidden and output learning rates ~ 1/fan_in, embeddings and biases constant) without base shapes.
    """

    def __init__(
        self,
        params,
        lr: float = 2**-7,
        betas: tuple[float, float] = SHARED_DEFAULTS["betas"],
        eps: float = SHARED_DEFAULTS["eps"],
        weight_decay: float = 0.0,
        **options: Unpack[SharedOptions],
    ):
        """``options``: the keywords every geometry optimizer shares (:class:`~moga.optim.options.SharedOptions`)."""
        self.role_geometries = role_geometries(Sign(), Embedding(q=INF), "adamw", update="adam")
        # Plain params get the hidden-matrix rule; a model's role plan decides per parameter. Adam keeps its own
        # moments (betas): no steepest-descent momentum.
        super().__init__(params, lr, momentum=0.0, nesterov=False, weight_decay=weight_decay, betas=betas, eps=eps,
                         geometry=Sign(), update="adam", **shared(type(self), options))
