"""The width paper's rescaled AdamW: Adam's direction in the sign geometry, so lr/fan_in on matrices."""

from __future__ import annotations

import torch

from moga.geometry import INF, Embedding, Sign
from moga.optim.base import GeometryOptimizer
from moga.roles import role_geometries


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
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        geometries=None,
        overrides=None,
        lr_multipliers=None,
        nonfinite: str = "skip",
        state_dtype: torch.dtype | str = torch.float32,
        master_weights: bool = False,
        kernel: str = "auto",
    ):
        self.role_geometries = role_geometries(Sign(), Embedding(q=INF), "adamw", update="adam")
        # Plain params get the hidden-matrix rule; a model's role plan decides per parameter.
        super().__init__(
            params, lr, 0.0, False, weight_decay, betas, eps, geometry=Sign(), update="adam",
            geometries=geometries, overrides=overrides, lr_multipliers=lr_multipliers, nonfinite=nonfinite,
            state_dtype=state_dtype, master_weights=master_weights,
            kernel=kernel,
        )
