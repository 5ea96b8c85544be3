"""Lipschitz and smoothness constants of a loss in the block norm of an optimizer's geometry.

The papers explain learning-rate transfer by these two numbers (docs/math.md §5): the depth paper says
both stay bounded as depth K grows with ``alpha = K_base/K``, the width paper that smoothness is width-independent in row and column geometries but can grow like
``sqrt(width)`` in Muon's. Unlike Euclidean tools (PyHessian), everything here is measured in the
parameter-space norm the optimizer steps in:

- :class:`BlockGeometry`: ``||W||_block = max_k ||W_k||_k`` over parameters, its dual ``sum_k ||G_k||_k*``
  and its LMO, from a role plan, a model or an optimizer;
- :func:`lipschitz`: ``||grad||_block,*``, exact (1 backward);
- :func:`smoothness`: a lower bound on ``sup |<H U, V>|`` over the unit ball by alternating LMO ascent
  (``starts * (iterations + 1)`` HVPs, reported with the iterations of every start);
- :func:`euclidean_top_eigenvalue`: power iteration or Lanczos, one HVP per iteration;
- :func:`measure`: all of them from one graph, for the ``moga smoothness`` command;
- along training: :func:`trajectory_smoothness`, :func:`descent_residual`, :func:`layer_diagnostics`,
  :func:`depth_paper_step` (``eta* = ||grad||_* / L``) and :class:`RunningSmoothness`.

Models and losses are ``loss_fn(model, batch) -> scalar tensor`` on a fixed probe batch. HVPs are double
backwards; :class:`moga.models.GPT` is switched to its twice-differentiable ``attention="math"`` path while
a Hessian graph is built. Put the model in ``eval()`` (or use no dropout) so that separate calls measure the
same function.
"""

from moga.smoothness.block import BlockEntry, BlockGeometry, difference, exact_geometry, inner
from moga.smoothness.diagnostics import (
    DescentResidual,
    RunningSmoothness,
    depth_paper_step,
    descent_residual,
    layer_diagnostics,
    trajectory_smoothness,
)
from moga.smoothness.estimates import (
    LOWER_BOUND_NOTE,
    AscentRun,
    EigenEstimate,
    Measurement,
    SmoothnessEstimate,
    block_smoothness,
    euclidean_top_eigenvalue,
    hessian_top_eigenvalue,
    lipschitz,
    measure,
    smoothness,
)
from moga.smoothness.hessian import HessianOperator, ProbePoint, double_backward_attention, gradient, probe

__all__ = [
    "BlockEntry", "BlockGeometry", "difference", "exact_geometry", "inner",
    "DescentResidual", "RunningSmoothness", "depth_paper_step", "descent_residual", "layer_diagnostics",
    "trajectory_smoothness",
    "LOWER_BOUND_NOTE", "AscentRun", "EigenEstimate", "Measurement", "SmoothnessEstimate", "block_smoothness",
    "euclidean_top_eigenvalue", "hessian_top_eigenvalue", "lipschitz", "measure", "smoothness",
    "HessianOperator", "ProbePoint", "double_backward_attention", "gradient", "probe",
]
