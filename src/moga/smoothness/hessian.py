"""Gradients and Hessian-vector products of ``loss_fn(model, batch)`` on a fixed probe batch.

An HVP is a double backward: the gradient is taken once with ``create_graph=True`` and every product
``H v = d<grad, v>/dW`` reuses that graph (``retain_graph=True``), so one :class:`HessianOperator` costs
one forward and one backward to build and about two backwards' worth of time per product, and holds the
forward and backward graphs in memory while it lives.

PyTorch's fused attention kernels have no double backward (pytorch/pytorch#116350); for
:class:`moga.models.GPT` the operator switches its attention to the plain ``"math"`` path while it builds
the graph (:func:`double_backward_attention`), which computes the same function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from moga.models.gpt import CausalSelfAttention

LossFn = Callable[[nn.Module, object], torch.Tensor]


@contextlib.contextmanager
def double_backward_attention(model: nn.Module):
    """Inside, every :class:`moga.models.gpt.CausalSelfAttention` of ``model`` uses ``attention="math"``."""
    switched = [m for m in model.modules() if isinstance(m, CausalSelfAttention) and m.attention != "math"]
    saved = [m.attention for m in switched]
    for m in switched:
        m.attention = "math"
    try:
        yield
    finally:
        for m, a in zip(switched, saved):
            m.attention = a


def _scalar_loss(loss_fn: LossFn, model: nn.Module, batch) -> torch.Tensor:
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn(model, batch) must return a scalar tensor, got {type(loss).__name__} "
                         f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    return loss.reshape(())


def gradient(model: nn.Module, loss_fn: LossFn, batch, params: Sequence[torch.Tensor]
             ) -> tuple[float, list[torch.Tensor]]:
    """``(loss, grad)`` at the current parameters: one forward and one backward, no graph kept.

    Parameters the loss does not reach get a zero gradient. ``.grad`` fields are left untouched.
    """
    params = list(params)
    with torch.enable_grad():
        loss = _scalar_loss(loss_fn, model, batch)
        grads = _grad(loss, params, create_graph=False)
    return float(loss.detach()), [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]


def _grad(loss: torch.Tensor, params: list[torch.Tensor], create_graph: bool) -> list[torch.Tensor | None]:
    """d loss / d params; None for a parameter the loss does not reach or that does not require grad."""
    live = [k for k, p in enumerate(params) if p.requires_grad]
    out: list[torch.Tensor | None] = [None] * len(params)
    if live and loss.requires_grad:
        found = torch.autograd.grad(loss, [params[k] for k in live], create_graph=create_graph, allow_unused=True)
        for k, g in zip(live, found):
            out[k] = g
    return out


@dataclass
class ProbePoint:
    """Loss, gradient and parameters at one point of a trajectory, all on the same probe batch."""

    loss: float
    grads: list[torch.Tensor]
    params: list[torch.Tensor]


def probe(model: nn.Module, loss_fn: LossFn, batch, params: Sequence[torch.Tensor]) -> ProbePoint:
    """The :class:`ProbePoint` at the current parameters (one forward and one backward)."""
    loss, grads = gradient(model, loss_fn, batch, params)
    return ProbePoint(loss, grads, [p.detach().clone() for p in params])


class HessianOperator:
    """``v -> H v`` for the Hessian of ``loss_fn(model, batch)`` in ``params`` at their current values.

    ``loss`` and ``grad`` at that point come for free. ``calls`` counts the products taken. Dropout masks
    and other randomness are frozen in the graph: every product is with the same Hessian. Take the
    products before the parameters change (they are not tracked).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, batch, params: Sequence[torch.Tensor]):
        self.params = list(params)
        with torch.enable_grad(), double_backward_attention(model):
            loss = _scalar_loss(loss_fn, model, batch)
            grads = _grad(loss, self.params, create_graph=True)
        self.loss = float(loss.detach())
        self.grad = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(self.params, grads)]
        # A gradient with no graph does not depend on any parameter: its rows (and columns) of H are zero.
        self._live = [k for k, g in enumerate(grads) if g is not None and g.requires_grad]
        self._grads = [grads[k] for k in self._live]
        self.calls = 0

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def __call__(self, vectors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(vectors) != len(self.params):
            raise ValueError(f"expected {len(self.params)} tensors, got {len(vectors)}")
        self.calls += 1
        out = [torch.zeros_like(p) for p in self.params]
        if not self._live:
            return out
        try:
            wrt = [k for k, p in enumerate(self.params) if p.requires_grad]
            found = torch.autograd.grad(
                self._grads, [self.params[k] for k in wrt],
                grad_outputs=[vectors[k].to(self.params[k].dtype) for k in self._live],
                retain_graph=True, allow_unused=True)
        except RuntimeError as e:
            if "derivative for" in str(e) and "not implemented" in str(e):
                raise RuntimeError(
                    "a Hessian-vector product needs a double backward through every op of the loss, and one "
                    f"of them has none ({e}). Fused attention kernels are the usual cause: use the model's "
                    "plain attention (moga.models.GPT(attention='math'); other models: torch's math SDPA "
                    "backend or an explicit softmax(q k^T) v)") from e
            raise
        for k, h in zip(wrt, found):
            if h is not None:
                out[k] = h.detach()
        return out

    # Flat views for the Euclidean methods, which need inner products and orthogonalization.

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, start = [], 0
        for p in self.params:
            out.append(flat[start:start + p.numel()].view_as(p))
            start += p.numel()
        return out

    def matvec(self, flat: torch.Tensor) -> torch.Tensor:
        return self.flatten(self(self.unflatten(flat)))
