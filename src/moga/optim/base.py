"""The one optimizer loop behind MOGA, Muon and rescaled AdamW: each param group names a geometry.

A group's ``update`` is ``"lmo"`` (steepest descent: ``D* = lmo(G)`` on the momentum EMA ``G``) or
``"adam"`` (Adam's ``m_hat / (sqrt(v_hat) + eps)`` in place of ``sign(G)`` in a sign geometry, with
that geometry's factor). Every step is ``W <- (1 - lr*wd) W + lr * D*`` (GEOMETRY.md).

Each group's geometry is parsed once, when the group is added (and again when a state dict is loaded),
into a :class:`~moga.geometry.Geometry` and the layout of each parameter; ``step`` uses those. The group
keeps the spec string, layout and update as plain strings only so that they survive ``state_dict`` and
``torch.load``'s ``weights_only`` mode; nothing is stored on tensors.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch
from torch import nn
from torch.optim import Optimizer

from moga.geometry import Geometry, Spectral, parse_geometry
from moga.kernels import DTYPES as KERNEL_DTYPES
from moga.kernels import check_kernel, covers, found_nonfinite, fused_available, fused_lmo_step_
from moga.layout import Layout, as_layout, resolve_layout
from moga.roles import RolePlan, build_plan
from moga.workspace import Workspace, scratch

NONFINITE_POLICIES = ("skip", "raise", "ignore")


def check_hyperparameters(h: Mapping) -> None:
    """Clear errors for values no run should start with."""

    def real(name, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
        return v

    if real("lr", h["lr"]) < 0:
        raise ValueError(f"lr must be >= 0, got {h['lr']}")
    if not 0 <= real("momentum", h["momentum"]) < 1:
        raise ValueError(f"momentum must be in [0, 1), got {h['momentum']}")
    if real("weight_decay", h["weight_decay"]) < 0:
        raise ValueError(f"weight_decay must be >= 0, got {h['weight_decay']}")
    betas = h["betas"]
    if len(betas) != 2 or not all(0 <= real("betas", b) < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if real("eps", h["eps"]) <= 0:
        raise ValueError(f"eps must be > 0, got {h['eps']}")
    if not isinstance(h["nesterov"], bool):
        raise ValueError(f"nesterov must be True or False, got {h['nesterov']!r}")
    if h.get("update", "lmo") not in ("lmo", "adam"):
        raise ValueError(f"update must be 'lmo' or 'adam', got {h['update']!r}")


class GeometryOptimizer(Optimizer):
    """Steepest descent with a geometry per param group.

    ``params`` is an ``nn.Module`` (its role plan is built with ``role_geometries``), a
    :class:`~moga.roles.RolePlan`, or torch-style params / param groups; a group without a ``geometry``
    key takes ``geometry`` and ``update``. ``nonfinite="skip"`` skips a step whose gradients hold NaN or inf and
    counts it in ``skipped_steps``; ``"raise"`` raises ``FloatingPointError``. Either way the weights and
    optimizer state are left untouched; ``"ignore"`` does not look (no check pass; NaN then reaches the
    weights). ``kernel="auto"`` runs the fused one-pass step of :mod:`moga.kernels` (C++ on CPU, compiled
    on CUDA) where it covers a parameter and falls back to the plain path, with a one-line warning, when
    it cannot be built; ``"cpp"`` insists on it, ``"torch"`` never uses it.
    """

    role_geometries: Mapping[str, str] = {}

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        *,
        geometry: Geometry | str | None = None,
        update: str = "lmo",
        geometries: Mapping[str, str] | None = None,
        overrides: Mapping | None = None,
        nonfinite: str = "skip",
        kernel: str = "auto",
    ):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.kernel = check_kernel(kernel)
        geometry = None if geometry is None else str(parse_geometry(geometry))  # the groups' default spec
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, betas=tuple(betas),
            eps=eps, geometry=geometry, update=update, layout=None,
        )
        check_hyperparameters(defaults)
        self.plan: RolePlan | None = None
        if isinstance(params, nn.Module):
            params = build_plan(params, {**self.role_geometries, **(geometries or {})}, overrides)
        elif geometries or overrides:
            raise ValueError("geometries= and overrides= apply to a model; pass the nn.Module itself")
        if isinstance(params, RolePlan):
            self.plan = params
            params = params.param_groups()
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self._workspace = Workspace()  # scratch for temporaries; not state, never saved
        self._plans: list[GroupPlan] = []  # per param group: its geometry and layouts; never saved
        super().__init__(params, defaults)
        # Build or load the fused kernel now (once per process), not inside a step that may be compiled.
        for device in {p.device for plan, group in zip(self._plans, self.param_groups) if group["update"] == "lmo"
                       and covers(plan.geometry) for p in group["params"]}:
            fused_available(self.kernel, device)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self._plans.append(_plan_group(self.param_groups[-1]))
        except Exception:
            self.param_groups.pop()  # a rejected group leaves the optimizer as it was
            raise

    # --- stepping ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.nonfinite != "ignore" and not self._gradients_finite():
            return loss
        for plan, group in zip(self._plans, self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = []
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("moga optimizers do not support sparse gradients")
                grads.append(p.grad)
            if group["update"] == "adam":
                self._adam_step(plan, group, params, grads)
            else:
                self._lmo_step(plan, group, params, grads)
        return loss

    def _lmo_step(self, plan: GroupPlan, group, params, grads):
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        if fused_available(self.kernel, params[0].device):
            bufs = [self._buffer(p, "momentum_buffer") for p in params] if momentum > 0 else None
            rest = fused_lmo_step_(plan.geometry, [plan.layout(p) for p in params], params, grads, bufs, lr,
                                   momentum, group["nesterov"], wd)
            params, grads = [params[k] for k in rest], [grads[k] for k in rest]
            if not params:
                return
        directions = grads
        if momentum > 0:
            directions = [self._buffer(p, "momentum_buffer") for p in params]
            torch._foreach_lerp_(directions, grads, 1 - momentum)  # the EMA G <- m G + (1 - m) g
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        if isinstance(plan.geometry, Spectral) and len(params) > 1:
            self._batched_spectral_step(plan, group, params, grads, directions)
            return
        for p, g, d in zip(params, grads, directions):
            if momentum > 0 and group["nesterov"]:
                d = torch.lerp(g, d, momentum, out=scratch(self._workspace, g, 2))
            plan.geometry.apply_lmo_(p, d, lr, plan.layout(p), self._workspace)

    def _batched_spectral_step(self, plan: GroupPlan, group, params, grads, directions):
        """Same-shape matrices go through one batched Newton-Schulz (bmm) call: a transformer's identical
        matrices cost one call, not one each. The stack is a batch axis ``b`` of the layout."""
        lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"] and group["momentum"] > 0
        batches: dict[tuple, list[int]] = {}
        for k, p in enumerate(params):
            batches.setdefault((p.shape, p.dtype, p.device, plan.layout(p)), []).append(k)
        for (shape, dtype, device, layout), ks in batches.items():
            stack = torch.empty((len(ks), *shape), dtype=dtype, device=device)
            for row, k in zip(stack, ks):
                if nesterov:
                    torch.lerp(grads[k], directions[k], momentum, out=row)
                else:
                    row.copy_(directions[k])
            weights = torch.stack([params[k] for k in ks])
            plan.geometry.apply_lmo_(weights, stack, lr, as_layout("b" + layout.spec), self._workspace)
            torch._foreach_copy_([params[k] for k in ks], list(weights.unbind(0)))

    def _adam_step(self, plan: GroupPlan, group, params, grads):
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        exp_avgs = [self._buffer(p, "exp_avg") for p in params]
        exp_avg_sqs = [self._buffer(p, "exp_avg_sq") for p in params]
        for st in states:
            st.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            st["step"] += 1
        if _fused_adamw_applies(params):
            self._fused_adam_step(plan, group, params, grads, exp_avgs, exp_avg_sqs, states)
            return
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        # The same expressions as torch.optim.AdamW with lr * c, c the geometry's sign factor.
        for p, m, v, st in zip(params, exp_avgs, exp_avg_sqs, states):
            t = st["step"].item()
            step_size = lr * plan.sign_scale(p) / (1 - beta1**t)
            denom = torch.sqrt(v, out=scratch(self._workspace, v, 0)).div_(math.sqrt(1 - beta2**t)).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)

    def _fused_adam_step(self, plan: GroupPlan, group, params, grads, exp_avgs, exp_avg_sqs, states):
        """torch's fused AdamW kernel, one call per sign factor c: lr*c, and decay wd/c so that the
        decay stays lr*wd. One pass over the tensors instead of about six."""
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        by_scale: dict[float, list[list]] = {}
        for p, g, m, v, st in zip(params, grads, exp_avgs, exp_avg_sqs, states):
            lists = by_scale.setdefault(plan.sign_scale(p), [[], [], [], [], []])
            for bucket, t in zip(lists, (p, g, m, v, st["step"])):
                bucket.append(t)
        for c, (ps, gs, ms, vs, steps) in by_scale.items():
            torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, lr=lr * c, beta1=beta1, beta2=beta2,
                                weight_decay=wd / c if wd else 0.0, eps=group["eps"], maximize=False,
                                grad_scale=None, found_inf=None)

    def _buffer(self, p: torch.Tensor, key: str) -> torch.Tensor:
        state = self.state[p]
        if key not in state:
            state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state[key]

    # --- non-finite gradients ----------------------------------------------------------------------

    def _gradients_finite(self) -> bool:
        named = [
            (group["names"][k] if "names" in group else f"group {gi} param {k}", p.grad)
            for gi, group in enumerate(self.param_groups)
            for k, p in enumerate(group["params"])
            if p.grad is not None
        ]
        if not named:
            return True
        # NaN and inf propagate through an l2 norm; it also overflows on huge finite values, so those
        # tensors are looked at again elementwise below.
        if all(g.device.type == "cpu" and g.dtype in KERNEL_DTYPES for _, g in named) and fused_available(
                self.kernel, torch.device("cpu")):
            if not found_nonfinite([g for _, g in named]):  # one exact read-only pass in C++
                return True
        flags = [_rows_finite(g) for _, g in named]
        same_device = len({f.device for f in flags}) == 1
        finite = torch.stack(flags).cpu() if same_device else torch.stack([f.cpu() for f in flags])  # one sync
        for k in torch.nonzero(~finite).flatten().tolist():
            finite[k] = bool(torch.isfinite(named[k][1]).all())
        if bool(finite.all()):
            return True
        bad = [named[k][0] for k in range(len(named)) if not finite[k]]
        message = f"non-finite gradient in {len(bad)} tensor(s): {', '.join(bad[:5])}"
        if self.nonfinite == "raise":
            raise FloatingPointError(message + "; weights and optimizer state are unchanged")
        if self.skipped_steps == 0:
            warnings.warn(message + "; step skipped (nonfinite='skip'; see skipped_steps)", RuntimeWarning, stacklevel=3)
        self.skipped_steps += 1
        return False

    # --- state ---------------------------------------------------------------------------------------

    def state_dict(self):
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.skipped_steps = int(state_dict.pop("skipped_steps", 0))
        super().load_state_dict(state_dict)
        self._plans = [_plan_group(group) for group in self.param_groups]


class GroupPlan:
    """What the step needs of one param group: its geometry, parsed once, and each parameter's layout."""

    def __init__(self, geometry: Geometry, layouts: dict[int, Layout | None]):
        self.geometry = geometry
        self._layouts = layouts  # by id(param)

    def layout(self, p: torch.Tensor) -> Layout | None:
        return self._layouts[id(p)]

    def sign_scale(self, p: torch.Tensor) -> float | None:
        return self.geometry.sign_scale(p.shape, self.layout(p))


def _plan_group(group: dict) -> GroupPlan:
    """Check a param group and parse its geometry; the group keeps the spec string (for state_dict)."""
    check_hyperparameters(group)
    if group["geometry"] is None:
        raise ValueError(
            "a param group has no geometry: pass geometry=Row(p=2) (or a spec such as 'row(p=2)'), give each "
            "group a 'geometry' key, or pass the model itself so that its role plan decides")
    geometry = parse_geometry(group["geometry"])
    group["geometry"] = str(geometry)
    layouts = {}
    for k, p in enumerate(group["params"]):
        name = group["names"][k] if "names" in group else f"params[{k}] of shape {tuple(p.shape)}"
        try:
            # A plain matrix defaults to "oi"; non-matrix geometries have no layout.
            layouts[id(p)] = resolve_layout(group["layout"], p) if geometry.matrix else None
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if group["update"] == "adam" and geometry.sign_scale(p.shape, layouts[id(p)]) is None:
            raise ValueError(f"{name}: update='adam' needs a sign geometry, not {geometry}")
    return GroupPlan(geometry, layouts)


def _rows_finite(g: torch.Tensor) -> torch.Tensor:
    """False when an l2 row norm of ``g`` is NaN or inf. Row norms: on CPUs a reduction along the last
    axis runs ~2x faster than ``_foreach_norm``."""
    if g.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=g.device)
    rows = g.reshape(-1, g.shape[-1]) if g.ndim else g.reshape(1, 1)
    return torch.linalg.vector_norm(rows, dim=-1).isfinite().all()


def _fused_adamw_applies(params: list[torch.Tensor]) -> bool:
    """torch's fused AdamW kernel exists for these tensors: one CPU or CUDA device, one float dtype."""
    if not hasattr(torch, "_fused_adamw_") or not params:
        return False
    device, dtype = params[0].device, params[0].dtype
    return (device.type in ("cpu", "cuda") and dtype in (torch.float32, torch.float64)
            and all(p.device == device and p.dtype == dtype for p in params))
