"""The one optimizer loop behind MOGA, Muon and rescaled AdamW: each param group names a geometry.

A group's ``update`` is ``"lmo"`` (steepest descent: ``D* = lmo(G)`` on the momentum EMA ``G``) or
``"adam"`` (Adam's ``m_hat / (sqrt(v_hat) + eps)`` in place of ``sign(G)`` in a sign geometry, with
that geometry's factor). Every step is ``W <- (1 - lr*wd) W + lr * D*`` (GEOMETRY.md). Geometry,
layout and update are strings in the group, so they survive ``state_dict`` and ``torch.load``'s
``weights_only`` mode; nothing is stored on tensors.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch
from torch import nn
from torch.optim import Optimizer

from moga.geometry import parse_geometry
from moga.layout import resolve_layout
from moga.optim import sharded
from moga.optim.sharded import DTensor, WholeJob, local
from moga.roles import RolePlan, build_plan
from moga.workspace import Workspace, scratch

NONFINITE_POLICIES = ("skip", "raise")


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
    optimizer state are left untouched. ``foreach=False`` selects the plain reference path.
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
        geometry: str | None = None,
        update: str = "lmo",
        geometries: Mapping[str, str] | None = None,
        overrides: Mapping | None = None,
        nonfinite: str = "skip",
        foreach: bool = True,
        distributed: bool | None = None,
    ):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, betas=tuple(betas),
            eps=eps, geometry=geometry, update=update, layout=None, foreach=foreach,
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
        self.distributed = distributed
        self.skipped_steps = 0
        self._workspace = Workspace()  # scratch for temporaries; not state, never saved
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_hyperparameters(group)
        if group["geometry"] is None:
            raise ValueError(
                "a param group has no geometry: pass geometry='row(p=2)' (or another spec), give each group "
                "a 'geometry' key, or pass the model itself so that its role plan decides")
        geometry = parse_geometry(group["geometry"])
        group["geometry"] = str(geometry)
        for k, p in enumerate(group["params"]):
            name = group["names"][k] if "names" in group else f"params[{k}] of shape {tuple(p.shape)}"
            try:
                layout = _layout_of(group, geometry, p)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            if group["update"] == "adam" and geometry.sign_scale(p.shape, layout) is None:
                raise ValueError(f"{name}: update='adam' needs a sign geometry, not {geometry}")
            sharded.check_placements(name, p, geometry if group["update"] == "lmo" else parse_geometry("sign"), layout)

    # --- stepping ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._gradients_finite():
            return loss
        whole: list[WholeJob] = []  # steps that need whole matrices, split among ranks after the loop
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = []
            for k, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("moga optimizers do not support sparse gradients")
                sharded.check_grad(group["names"][k] if "names" in group else f"params[{k}]", p)
                grads.append(p.grad)
            if group["update"] == "adam":
                self._adam_step(group, params, grads)
            else:
                whole += self._lmo_step(group, params, grads)
        sharded.step_whole(whole)
        return loss

    def _lmo_step(self, group, params, grads) -> list[WholeJob]:
        geometry = parse_geometry(group["geometry"])
        lr, momentum, wd, fast = group["lr"], group["momentum"], group["weight_decay"], group["foreach"]
        workspace = self._workspace if fast else None
        # DTensor parameters (FSDP2) step on their local shards; see moga.optim.sharded.
        shards, grads = [local(p) for p in params], [local(g) for g in grads]
        directions = grads
        if momentum > 0:
            directions = [local(self._buffer(p, "momentum_buffer")) for p in params]
            _lerp_(directions, grads, 1 - momentum, fast)  # the EMA G <- m G + (1 - m) g
        if wd:
            _mul_(shards, 1 - lr * wd, fast)
        whole = []  # spectral steps on sharded or replicated-across-ranks matrices
        split_replicated = sharded.replicated_world(self.distributed)
        for p, w, g, d in zip(params, shards, grads, directions):
            layout = _layout_of(group, geometry, p)
            defer = sharded.reduced_dims(geometry, layout) == sharded.WHOLE and (
                isinstance(p, DTensor) or split_replicated)
            if momentum > 0 and group["nesterov"]:
                d = torch.lerp(g, d, momentum, out=None if defer else scratch(workspace, g, 2))
            if defer:
                whole.append(WholeJob(p, d, geometry, layout, lr))
                continue
            layout, reduce = sharded.lmo_args(p, geometry, layout)
            if reduce is not None:
                geometry.apply_lmo_(w, d, lr, layout, workspace, reduce=reduce)
            elif fast or w is not p:
                geometry.apply_lmo_(w, d, lr, layout, workspace)
            else:
                p.add_(geometry.lmo(d, layout), alpha=lr)
        return whole

    def _adam_step(self, group, params, grads):
        geometry = parse_geometry(group["geometry"])
        lr, wd, eps, fast = group["lr"], group["weight_decay"], group["eps"], group["foreach"]
        workspace = self._workspace if fast else None
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        exp_avgs = [local(self._buffer(p, "exp_avg")) for p in params]
        exp_avg_sqs = [local(self._buffer(p, "exp_avg_sq")) for p in params]
        shapes = [p.shape for p in params]  # global shapes: the sign factor 1/fan_in is the whole matrix's
        params, grads = [local(p) for p in params], [local(g) for g in grads]
        for st in states:
            st.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            st["step"] += 1
        if fast and _fused_adamw_applies(params):
            self._fused_adam_step(group, geometry, params, shapes, grads, exp_avgs, exp_avg_sqs, states)
            return
        _lerp_(exp_avgs, grads, 1 - beta1, fast)
        if fast:
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        else:
            for v, g in zip(exp_avg_sqs, grads):
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if wd:
            _mul_(params, 1 - lr * wd, fast)
        # The same expressions as torch.optim.AdamW with lr * c, c the geometry's sign factor.
        for p, shape, m, v, st in zip(params, shapes, exp_avgs, exp_avg_sqs, states):
            t = st["step"].item()
            layout = _layout_of(group, geometry, torch.empty(shape, device="meta"))
            step_size = lr * geometry.sign_scale(shape, layout) / (1 - beta1**t)
            denom = torch.sqrt(v, out=scratch(workspace, v, 0)).div_(math.sqrt(1 - beta2**t)).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)

    def _fused_adam_step(self, group, geometry, params, shapes, grads, exp_avgs, exp_avg_sqs, states):
        """torch's fused AdamW kernel, one call per sign factor c: lr*c, and decay wd/c so that the
        decay stays lr*wd. One pass over the tensors instead of about six."""
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        by_scale: dict[float, list[list]] = {}
        for p, shape, g, m, v, st in zip(params, shapes, grads, exp_avgs, exp_avg_sqs, states):
            layout = _layout_of(group, geometry, torch.empty(shape, device="meta"))
            lists = by_scale.setdefault(geometry.sign_scale(shape, layout), [[], [], [], [], []])
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
        flags = [_rows_finite(local(g)) for _, g in named]
        same_device = len({f.device for f in flags}) == 1
        finite = torch.stack(flags).cpu() if same_device else torch.stack([f.cpu() for f in flags])  # one sync
        for k in torch.nonzero(~finite).flatten().tolist():
            finite[k] = bool(torch.isfinite(local(named[k][1])).all())
        # Shards of one tensor live on several ranks: AND the flags so every rank skips alike.
        finite = sharded.combine_flags([g for _, g in named], finite)
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


def _layout_of(group: dict, geometry, p: torch.Tensor):
    """The group's layout for ``p`` (a plain matrix defaults to "oi"); None for non-matrix geometries."""
    return resolve_layout(group["layout"], p) if geometry.matrix else None


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


def _lerp_(targets: list[torch.Tensor], sources: list[torch.Tensor], weight: float, fast: bool) -> None:
    if fast:
        torch._foreach_lerp_(targets, sources, weight)
    else:
        for t, s in zip(targets, sources):
            t.lerp_(s, weight)


def _mul_(tensors: list[torch.Tensor], factor: float, fast: bool) -> None:
    if fast:
        torch._foreach_mul_(tensors, factor)
    else:
        for t in tensors:
            t.mul_(factor)

