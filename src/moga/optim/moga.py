"""MOGA: row(p) steepest descent on every matrix, the embedding geometry on tables, Adam or sign on vectors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moga.geometry import Embedding, Geometry, Row
from moga.optim.base import GeometryOptimizer
from moga.optim.multipliers import preset_options
from moga.optim.options import SharedOptions, shared
from moga.roles import MOGA_GEOMETRIES, role_geometries

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+; annotations are not evaluated at run time
    from typing_extensions import Unpack


class MOGA(GeometryOptimizer):
    """Matrix Operator Geometry Aware steepest descent (the width paper).

    One ``lr`` serves every layer: hidden and readout matrices take the ``(p,mean)->inf`` row LMO,
    embeddings ``1->(q,mean)`` and vectors (biases, norm gains) ``vectors="adamw"`` (Adam's direction) or
    ``"sign"`` (the l_inf LMO). Momentum is an EMA of gradients, Nesterov's look-ahead or plain; weight decay
    is decoupled, ``W <- (1 - lr*wd) W + lr * D*``, and skips vectors when the plan comes from the model.

    ``preset`` names a set of defaults (:data:`~moga.optim.multipliers.PRESETS`): per-role lr multipliers and
    the momentum. ``"paper"`` is the width paper's exact choice, every role at ``lr`` with plain momentum;
    ``"default"`` is MOGA's default, the embedding tables at ``lr / 16`` (a tied table-and-head keeps ``lr``)
    with Nesterov momentum. ``lr_multipliers`` override the preset's role by role (a preset's multiplier for a
    role the model lacks is skipped), and ``nesterov=True/False`` overrides its momentum; ``nesterov=None``
    takes the preset's. The groups keep the preset's name, their ``lr_multiplier`` and ``nesterov``, so
    schedulers and ``state_dict`` keep them. With torch-style param groups there are no roles: the preset's
    multipliers do not apply, its momentum does.

    >>> opt = MOGA(model, lr=2**-3)           # role plan from the unmodified model
    >>> print(opt.plan)                        # what each parameter gets, with its lr multiplier
    >>> MOGA(model, lr=2**-3, preset="paper")  # the width paper's choice, whatever the default becomes
    """

    role_geometries = MOGA_GEOMETRIES

    def __init__(
        self,
        params,
        lr: float = 2**-5,
        momentum: float = 0.9,
        nesterov: bool | None = None,
        weight_decay: float = 0.0,
        *,
        p: float = 2.0,
        embedding_q: float = 2.0,
        vectors: str = "adamw",
        geometry: Geometry | str | None = None,
        preset: str = "default",
        **options: Unpack[SharedOptions],
    ):
        """``options``: the keywords every geometry optimizer shares (:class:`~moga.optim.options.SharedOptions`)."""
        chosen = preset_options(preset)  # a bad name fails before anything is built
        self.preset, self.preset_multipliers = preset, dict(chosen.lr_multipliers)
        nesterov = chosen.nesterov if nesterov is None else nesterov  # the user's True/False wins
        if chosen.hidden and "hidden" not in (options.get("geometries") or {}):  # the user's geometry wins
            options["geometries"] = {**(options.get("geometries") or {}), "hidden": chosen.hidden}
        self.role_geometries = role_geometries(Row(p), Embedding(embedding_q), vectors)
        super().__init__(params, lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         geometry=geometry, **shared(type(self), options))
