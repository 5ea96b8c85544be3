"""The convergence paper's adaptive step for gradient descent (docs/math.md §6).

    eta_t = alpha * ||W_0||^(2L-2) / ((1 + Loss(W_t)^(1/2)) * sum_{j=0}^{2L-2} ||W_t||^j)

with ``||W||`` the Frobenius norm of all weights together and ``L`` the number of layers. The powers
overflow float64 quickly (``||W|| = 40``, ``L = 100``: ``40^198``), so the step is computed as a
logarithm in float64, with the geometric sum in closed form ``(r^n - 1)/(r - 1)``, n = 2L-1 terms.
"""

from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

from moga.optim.nonfinite import check_policy



def _log_expm1(a: float) -> float:
    """log(e^a - 1) for a > 0, without overflow for large a."""
    return a + math.log1p(-math.exp(-a)) if a > 30 else math.log(math.expm1(a))


def log_geometric_sum(log_r: float, n: int) -> float:
    """``log(sum_{j=0}^{n-1} r^j)`` for ``r = exp(log_r) >= 0``: the closed form ``(r^n - 1)/(r - 1)`` in logs.

    expm1 keeps it exact near r = 1 (where the sum is ~n), and splitting off the exponent keeps it
    finite for any r and n.
    """
    if n < 1:
        raise ValueError(f"need at least one term, got n={n}")
    if log_r == -math.inf or n == 1:
        return 0.0
    if log_r == 0:
        return math.log(n)
    x = n * log_r
    if log_r > 0:
        return _log_expm1(x) - _log_expm1(log_r)
    return math.log(-math.expm1(x)) - math.log(-math.expm1(log_r))


def log_adaptive_step(alpha: float, layers: int, w0_norm: float, w_norm: float, loss: float) -> float:
    """log(eta_t) of the formula above, all in float64."""
    if alpha < 0 or layers < 1 or w0_norm < 0 or w_norm < 0:
        raise ValueError(f"need alpha >= 0, layers >= 1 and norms >= 0, got {alpha}, {layers}, {w0_norm}, {w_norm}")
    if not math.isfinite(loss) or loss < 0:
        raise FloatingPointError(f"the adaptive step needs a finite loss >= 0, got {loss}")
    if alpha == 0:
        return -math.inf
    power = 2 * layers - 2
    if power and w0_norm == 0:  # ||W_0||^(2L-2) = 0: the step is zero
        return -math.inf
    log_w0 = power * math.log(w0_norm) if power else 0.0  # ||W_0||^0 = 1, even for W_0 = 0
    log_w = math.log(w_norm) if w_norm > 0 else -math.inf
    return math.log(alpha) + log_w0 - math.log1p(math.sqrt(loss)) - log_geometric_sum(log_w, 2 * layers - 1)


def adaptive_step(alpha: float, layers: int, w0_norm: float, w_norm: float, loss: float) -> float:
    log_eta = log_adaptive_step(alpha, layers, w0_norm, w_norm, loss)
    if log_eta > 709:  # exp would overflow float64
        raise FloatingPointError(f"adaptive step exp({log_eta:.1f}) overflows: ||W_t|| = {w_norm:.3g} is "
                                 f"tiny next to ||W_0|| = {w0_norm:.3g}")
    return math.exp(log_eta)


def global_norm(tensors) -> float:
    """Frobenius norm of all tensors together, in float64, robust to huge entries. One host read (more
    only when some tensor's squares overflow float64)."""
    tensors = [t.detach() for t in tensors]
    value = float(_device_norm(tensors)) if tensors else 0.0
    return value if math.isfinite(value) else _exact_global_norm(tensors)


def _device_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The Frobenius norm of them all as a 0-d float64 on the first one's device, read nowhere: each
    tensor's norm in float64, combined as ``top * sqrt(sum((n / top)^2))``. inf or NaN when a tensor's
    squares overflow (or it holds inf or NaN): :func:`_exact_global_norm` then decides."""
    device = tensors[0].device
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64).to(device) for t in tensors])
    top = norms.amax()
    return top * (norms / torch.where(top > 0, top, 1.0)).square().sum().sqrt()


def _exact_global_norm(tensors: list[torch.Tensor]) -> float:
    norms = [_norm64(t) for t in tensors]
    top = max(norms, default=0.0)
    if top == 0 or not math.isfinite(top):
        return top
    return top * math.sqrt(sum((n / top) ** 2 for n in norms))


def _norm64(t: torch.Tensor) -> float:
    n = float(torch.linalg.vector_norm(t, dtype=torch.float64))
    if math.isinf(n) and bool(torch.isfinite(t).all()):  # the squares overflowed: rescale by the largest entry
        top = t.abs().max().double()
        n = float(top * torch.linalg.vector_norm(t.double() / top))
    return n


def _check_w0(w0_norm: float, layers: int) -> None:
    """eta_t is proportional to ||W_0||^(2L-2): zero weights at the start would never move, silently."""
    if layers >= 2 and w0_norm == 0:
        raise ValueError(f"AdaptiveGD with ||W_0|| = 0 and L = {layers}: every step would be zero (eta_t is "
                         "proportional to ||W_0||^(2L-2)); initialise the weights away from zero, or pass w0_norm")
    if not math.isfinite(w0_norm) or w0_norm < 0:
        raise ValueError(f"AdaptiveGD needs a finite ||W_0|| >= 0, got {w0_norm}")


class AdaptiveGD(Optimizer):
    """Gradient descent with the convergence paper's adaptive step ``W <- W - eta_t * grad``.

    ``alpha`` is stored as each group's ``lr`` (so a schedule that scales lr scales alpha); ``layers`` is
    L. ``||W_0||`` is measured at the first step unless given. Each step needs the loss at ``W_t``:
    ``step(closure)`` or ``step(loss=value)``. Full-batch or minibatch alike: the loss is whatever the
    gradient came from. After a step, ``last`` holds ``eta``, ``w_norm``, ``w0_norm`` and ``loss``.

    Non-finite values, as the geometry optimizers: ``nonfinite="skip"`` (default) turns a step whose loss or
    gradients hold NaN or inf into a no-op (the weights stay bit for bit as they were; ``skipped_steps``
    counts it), ``"raise"`` raises ``FloatingPointError`` naming them, ``"ignore"`` checks the gradients no
    more (a non-finite loss still raises: it has no step size).
    """

    needs_loss = True

    def __init__(self, params, alpha: float = 1.0, layers: int = 2, *, w0_norm: float | None = None,
                 nonfinite: str = "skip"):
        check_policy(nonfinite)
        if not math.isfinite(alpha) or alpha < 0:
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
        if int(layers) != layers or layers < 1:
            raise ValueError(f"layers (L) must be an integer >= 1, got {layers}")
        super().__init__(params, dict(lr=alpha))
        self.layers = int(layers)
        self.w0_norm = None if w0_norm is None else float(w0_norm)
        if self.w0_norm is not None:
            _check_w0(self.w0_norm, self.layers)
        self.last: dict[str, float] = {}
        self.nonfinite = nonfinite
        self.skipped_steps = 0

    def parameters(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None, *, loss: float | torch.Tensor | None = None):
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if loss is None:
            raise ValueError("AdaptiveGD needs the loss at W_t: call step(closure) or step(loss=value)")
        value, w_norm, finite = self._read(loss)
        if self.nonfinite != "ignore" and self._refuse_nonfinite(value, finite):
            return loss
        if self.w0_norm is None:
            self.w0_norm = w_norm
        _check_w0(self.w0_norm, self.layers)
        ratio = adaptive_step(1.0, self.layers, self.w0_norm, w_norm, value)  # eta_t / alpha
        for group in self.param_groups:
            eta = group["lr"] * ratio
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-eta)
        self.last = {"eta": self.param_groups[0]["lr"] * ratio, "w_norm": w_norm,
                     "w0_norm": self.w0_norm, "loss": value}
        return loss

    def _read(self, loss: float | torch.Tensor) -> tuple[float, float, bool]:
        """(loss, ||W_t||, every gradient finite), read from the device together: one sync per step."""
        params = [p.detach() for p in self.parameters()]
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not params:
            return float(loss), 0.0, True
        device = params[0].device
        parts = [_device_norm(params)]
        if self.nonfinite != "ignore" and grads:
            parts.append(torch.stack([torch.isfinite(g).all().to(device) for g in grads]).all().double())
        if isinstance(loss, torch.Tensor):
            parts.append(loss.detach().to(device=device, dtype=torch.float64).reshape(()))
        values = torch.stack(parts).tolist()
        w_norm = values[0] if math.isfinite(values[0]) else _exact_global_norm(params)
        finite = bool(values[1]) if self.nonfinite != "ignore" and grads else True
        return (values[-1] if isinstance(loss, torch.Tensor) else float(loss)), w_norm, finite

    def _refuse_nonfinite(self, loss: float, finite: bool) -> bool:
        """True when this step is skipped for a non-finite loss or gradient (or raises, by the policy)."""
        if math.isfinite(loss) and finite:
            return False
        bad = [f"group {gi} param {k}" for gi, group in enumerate(self.param_groups)
               for k, p in enumerate(group["params"])
               if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        what = [] if math.isfinite(loss) else [f"loss {loss}"]
        what += [f"gradient in {', '.join(bad[:5])}"] if bad else []
        if self.nonfinite == "raise":
            raise FloatingPointError(f"non-finite {' and '.join(what)}; the weights are unchanged")
        self.skipped_steps += 1
        return True

    def diagnostics(self) -> dict[str, float]:
        """What the training engine logs beside its own loss: eta_t, ||W_t|| and ||W_0||."""
        return {k: v for k, v in self.last.items() if k != "loss"}

    def state_dict(self):
        state = super().state_dict()
        state["adaptive"] = {"w0_norm": self.w0_norm, "layers": self.layers, "skipped_steps": self.skipped_steps}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("adaptive", {})
        if extra.get("layers", self.layers) != self.layers:
            raise ValueError(f"state is for L={extra['layers']}, this optimizer has L={self.layers}")
        self.w0_norm = extra.get("w0_norm", self.w0_norm)
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        super().load_state_dict(state_dict)
