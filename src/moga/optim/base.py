"""The one optimizer loop behind MOGA, Muon and rescaled AdamW: each param group names a geometry.

A group's ``update`` is ``"lmo"`` (steepest descent: ``D* = lmo(G)`` on the momentum EMA ``G``) or
``"adam"`` (Adam's ``m_hat / (sqrt(v_hat) + eps)`` in place of ``sign(G)`` in a sign geometry, with
that geometry's factor). Every step is ``W <- (1 - lr*wd) W + lr * D*`` (docs/math.md §1.4, §3.1).

Each group's geometry is parsed once, when the group is added (and again when a state dict is loaded),
into a :class:`~moga.geometry.Geometry` and the layout of each parameter; ``step`` uses those. The group
keeps the spec string, layout and update as plain strings only so that they survive ``state_dict`` and
``torch.load``'s ``weights_only`` mode; nothing is stored on tensors.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping

import torch
from torch import nn
from torch.optim import Optimizer

from moga.geometry import Geometry, Spectral, parse_geometry
from moga.kernels import DTYPES as KERNEL_DTYPES
from moga.kernels import (all_finite, check_kernel, covers, fused_available, fused_lmo_step_, fused_ready,
                          fused_split_step_, plain_tensor)
from moga.layout import Layout, as_layout, resolve_layout
from moga.optim import sharded
from moga.optim.multipliers import apply_multipliers
from moga.optim.sharded import DTensor, WholeJob, local
from moga.roles import RolePlan, build_plan
from moga.workspace import Workspace, scratch

NONFINITE_POLICIES = ("skip", "raise", "ignore")


def _real(name: str, v):
    """A finite real number of any kind (int, float, numpy scalar, 0-d tensor) as a Python float."""
    if isinstance(v, torch.Tensor) and v.ndim == 0 and not v.is_complex() and v.dtype != torch.bool:
        v = v.item()  # at construction only, never in step
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number (any real type), got {v!r}")
    return float(v)


def warn_if_decay_diverges(param_groups, stacklevel: int = 3) -> None:
    """Decoupled decay multiplies W by (1 - lr*wd) each step: past lr*wd = 1 that flips every weight's sign,
    past 2 it grows them without bound (inf within tens of steps). A likely unit mix-up; warn, once."""
    worst = max((g["lr"] * g["weight_decay"] for g in param_groups
                 if isinstance(g.get("lr"), (int, float)) and g.get("weight_decay")), default=0.0)
    if worst > 1:
        warnings.warn(f"lr x weight_decay = {worst:.3g} > 1: each step multiplies the weights by (1 - lr*wd) = "
                      f"{1 - worst:.3g}, flipping their sign{' and growing them to inf' if worst > 2 else ''}. "
                      "Weight decay here is decoupled (scaled by lr): use weight_decay below 1/lr", stacklevel=stacklevel)


def check_hyperparameters(h: dict) -> None:
    """Clear errors for values no run should start with; numbers are stored as Python floats."""
    h["lr"] = _real("lr", h["lr"])
    if h["lr"] < 0:
        raise ValueError(f"lr must be >= 0, got {h['lr']}")
    h["momentum"] = _real("momentum", h["momentum"])
    if not 0 <= h["momentum"] < 1:
        raise ValueError(f"momentum must be in [0, 1), got {h['momentum']}")
    h["weight_decay"] = _real("weight_decay", h["weight_decay"])
    if h["weight_decay"] < 0:
        raise ValueError(f"weight_decay must be >= 0, got {h['weight_decay']}")
    betas = h["betas"]
    if len(betas) != 2 or not all(0 <= _real("betas", b) < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    h["betas"] = tuple(_real("betas", b) for b in betas)
    h["eps"] = _real("eps", h["eps"])
    if h["eps"] <= 0:
        raise ValueError(f"eps must be > 0, got {h['eps']}")
    if not isinstance(h["nesterov"], bool):
        raise ValueError(f"nesterov must be True or False, got {h['nesterov']!r}")
    if h.get("update", "lmo") not in ("lmo", "adam"):
        raise ValueError(f"update must be 'lmo' or 'adam', got {h['update']!r}")


class GeometryOptimizer(Optimizer):
    """Steepest descent with a geometry per param group.

    ``params`` is an ``nn.Module`` (its role plan is built with ``role_geometries``), a
    :class:`~moga.roles.RolePlan`, or torch-style params / param groups; a group without a ``geometry``
    key takes ``geometry`` and ``update``. With a model or a plan, the vector role's groups (biases, norm
    gains, scalars) are not decayed, as in Trainer's and nanoGPT's optimizers. ``lr_multipliers={"readout": 0.5, ...}`` (a model or plan only)
    sets each named role's groups to ``lr`` times its multiplier (:mod:`moga.optim.multipliers`).

    Non-finite values. ``nonfinite="skip"`` (default) turns a step whose gradients hold NaN or inf, or
    whose lr is not finite, into a no-op on the device: weights and optimizer state stay bit for bit
    as they were, and ``skipped_steps`` counts it. The step never waits for the device; reading
    ``skipped_steps`` (or ``state_dict``) does. ``"raise"`` raises ``FloatingPointError`` naming the
    tensors, leaving everything untouched; it reads the flag on the host every step (a device sync).
    ``"ignore"`` turns the gradient check off. A caller that already knows, passes ``step(found_inf=flag)``
    and the optimizer does not read the gradients for it: ``moga train`` passes clipping's verdict, and
    ``torch.amp.GradScaler`` its own (with its loss scale, which the step divides out), as for torch's
    fused optimizers. ``torch.compile(opt.step)`` works: the step then uses ops that compile in place of
    torch's fused AdamW and SGD kernels.

    Precision. The math runs in float32 for 16-bit parameters (float64 for float64 ones). Momentum and
    Adam moments are kept in ``state_dtype`` (float32 by default; ``torch.bfloat16`` halves their
    memory); float64 parameters keep float64 state. ``master_weights=True`` keeps a float32 copy of
    each 16-bit parameter in its state: the step updates the copy and rounds it into the parameter, so
    steps smaller than the parameter's precision still accumulate. Without it, 16-bit parameters are
    updated in place (the update computed in float32, then rounded).

    Measured on GPT-2-small matrices (768x768, 3072x768, 768x3072; weights ~0.02, gradients ~1e-3, default
    lr), one bf16 step against the float32 step from the same weights, as relative errors of the update
    (and of the weights): MOGA row(2) 0.63 (9.8e-4) in place, 1.7e-3 (2.6e-6) in the master copy; Muon
    0.064 (1.7e-3) in place, 2.1e-3 (5.6e-5) in the master copy; ScaledAdamW 0.93 (3.6e-4) in place,
    3.0e-5 (1.2e-8) in the master copy. In place, updates below half a bf16 spacing of the weight are lost:
    use master weights for bf16 training. bfloat16 state on float32 parameters: 1.9e-3 (2.3e-5) after 10
    MOGA steps.
    Kernels. ``kernel="auto"`` (default) runs the fused one-pass step of :mod:`moga.kernels` (C++ on CPU,
    compiled on CUDA) for the row, col, sign and embedding groups it covers, FSDP2 shards included, and
    falls back to the plain path, with a one-line warning, when it cannot be built; ``"cpp"`` insists on
    it, ``"torch"`` never uses it. It keeps the non-finite semantics above (a skipped step leaves
    everything untouched).
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
        lr_multipliers: Mapping[str, float] | None = None,
        nonfinite: str = "skip",
        state_dtype: torch.dtype | str = torch.float32,
        master_weights: bool = False,
        distributed: bool | None = None,
        kernel: str = "auto",
    ):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.kernel = check_kernel(kernel)
        self.state_dtype = _state_dtype(state_dtype)
        self.master_weights = bool(master_weights)
        geometry = None if geometry is None else str(parse_geometry(geometry))  # the groups' default spec
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, betas=betas,
            eps=eps, geometry=geometry, update=update, layout=None,
        )
        check_hyperparameters(defaults)
        self.plan: RolePlan | None = None
        if isinstance(params, nn.Module):
            params = build_plan(params, {**self.role_geometries, **(geometries or {})}, overrides)
        elif geometries or overrides:
            raise ValueError("geometries= and overrides= apply to a model; pass the nn.Module itself")
        elif geometry is None:
            params = list(params)
            if any(not isinstance(g, Mapping) or "geometry" not in g for g in params):
                name = type(self).__name__
                raise ValueError(
                    f"{name} gives each parameter the geometry of its role, which it reads from the model: pass "
                    f"the model, {name}(model) (in Hugging Face's Trainer: optimizer_cls_and_kwargs=({name}, "
                    f"{{'model': model, ...}})), or give every param group a 'geometry'")
        if isinstance(params, RolePlan):
            self.plan = params
            params = params.param_groups()
            for group in params:  # one rule everywhere (docs/integrations.md): vectors are not decayed
                if group["role"] == "vector":
                    group["weight_decay"] = 0.0
        if lr_multipliers:  # each role's group at lr x its multiplier (moga.optim.multipliers)
            params = apply_multipliers(params if self.plan is not None else None, defaults["lr"], lr_multipliers)
        self.nonfinite = nonfinite
        self.distributed = distributed  # split whole-matrix work across ranks for plain tensors (see Muon)
        self._skipped_host = 0  # skips known on the host (a non-finite lr)
        self._skipped_device: torch.Tensor | None = None  # skips flagged on the device, read lazily
        self._workspace = Workspace()  # scratch for temporaries; not state, never saved
        self._plans: list[GroupPlan] = []  # per param group: its geometry and layouts; never saved
        super().__init__(params, defaults)
        warn_if_decay_diverges(self.param_groups)
        # Build or load the fused kernel now (once per process), not inside a step that may be compiled.
        for device in {p.device for plan, group in zip(self._plans, self.param_groups)  # a DTensor's: its shard's
                       if group["update"] == "lmo" and covers(plan.geometry) for p in group["params"]}:
            fused_available(self.kernel, device)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self._plans.append(_plan_group(self.param_groups[-1]))
        except Exception:
            self.param_groups.pop()  # a rejected group leaves the optimizer as it was
            raise

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients or lr. Reading it waits for the device."""
        on_device = 0 if self._skipped_device is None else int(self._skipped_device)
        return self._skipped_host + on_device

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_host, self._skipped_device = int(value), None

    # --- stepping ------------------------------------------------------------------------------------

    # torch.amp.GradScaler hands this optimizer its loss scale and verdict instead of unscaling and checking
    # the gradients itself (the protocol of torch's fused optimizers): see ``step``.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, *, found_inf: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None):
        """One step. ``found_inf``, a 0-d tensor (nonzero: some gradient is NaN or inf), is a verdict the
        caller already has, say from a non-finite global gradient norm: it replaces the optimizer's own pass
        over the gradients (``nonfinite`` still decides what a set flag does; "ignore" skips too), and must
        agree on every rank. ``grad_scale``: the gradients are that many times the true ones; they are divided
        by it in place first. torch.amp.GradScaler passes both, as the attributes ``found_inf`` and
        ``grad_scale`` that it sets around the call."""
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for gi, (plan, group) in enumerate(zip(self._plans, self.param_groups)):
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.layout != torch.strided for p in params):
                raise RuntimeError("moga optimizers do not support sparse gradients")
            params = [p for p in params if p.numel()]  # a zero-size parameter has nothing to step
            for p in params:
                sharded.check_grad(lambda: _name_of(group, p), p)
                plan.check_shape(lambda: _name_of(group, p), p)
            if params:
                work.append((gi, plan, group, params))
        if not work or not self._lr_finite(work):
            return loss
        self._init_group(self.param_groups[work[0][0]])  # every group's state, in one call (see there)
        if grad_scale is not None:
            _unscale_([local(p.grad) for *_, params in work for p in params], grad_scale)
        ok = self._gradients_ok(work) if found_inf is None else self._flag_ok(work, found_inf)
        whole: list[WholeJob] = []  # steps that need whole matrices, split among ranks after the loop
        rounding = []
        for _, plan, group, params in work:
            if group["update"] == "adam":
                self._adam_step(plan, group, params, ok)
            else:
                whole += self._lmo_step(plan, group, params, ok, rounding)
        sharded.step_whole(whole)
        for params, targets in rounding:
            _round_into(params, targets)
        if ok is not None:
            self._skipped_device.add_((~ok).to(self._skipped_device.device))
        return loss

    def _lmo_step(self, plan: GroupPlan, group, params, ok, rounding: list) -> list[WholeJob]:
        """Steps what it can; returns the steps that need whole matrices from other ranks, and leaves
        rounding master copies into ``rounding`` (done after those)."""
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        if covers(plan.geometry) and fused_available(self.kernel, local(params[0]).device):
            params = self._fused_lmo_step(plan, group, params, ok)
            if not params:
                return []
        # What is left (spectral, p = inf, master copies, kernel="torch", CUDA shards split over ranks) steps
        # here, DTensor parameters on their local shards: moga.optim.sharded.
        targets = self._targets(params)
        rounding.append((params, targets))
        targets = [local(t) for t in targets]
        grads = self._grads(params, ok)
        alpha = _gate(ok, lr, 0.0)  # 0 on a skipped step: every geometry maps a finite G to a no-op
        directions = grads
        if momentum > 0:
            bufs = [local(self._buffer(p, "momentum_buffer")) for p in params]
            directions = _in_compute_dtype(bufs)
            _ema_(directions, grads, 1 - momentum, ok)  # G <- m G + (1 - m) g
            _write_back(bufs, directions)
        if wd:
            torch._foreach_mul_(targets, _gate(ok, 1 - lr * wd, 1.0))
        whole = []
        split_replicated = sharded.replicated_world(self.distributed)
        if (isinstance(plan.geometry, Spectral) and len(params) > 1 and not split_replicated
                and not any(isinstance(p, DTensor) for p in params)):
            self._batched_spectral_step(plan, group, targets, params, grads, directions, alpha, ok)
            return whole
        for t, p, g, d in zip(targets, params, grads, directions):
            layout = plan.layout(p)
            defer = sharded.needs_whole(plan.geometry, layout) and (isinstance(p, DTensor) or split_replicated)
            out = None if defer else scratch(self._workspace, g, 2)  # deferred directions need their own memory
            if momentum > 0 and group["nesterov"]:
                d = _finite(torch.lerp(g, d, momentum, out=out), ok)
            elif momentum == 0 and ok is not None:  # a NaN would pass through the zero step size
                d = torch.where(ok, d, d.new_zeros(()), out=out)
            if defer:
                whole.append(WholeJob(p, t, d, plan.geometry, layout, alpha))
            else:
                plan.geometry.apply_lmo_(t, d, alpha, layout, self._workspace, sharded.reducer(p, plan.geometry, layout))
        return whole

    def _fused_lmo_step(self, plan: GroupPlan, group, params, ok) -> list[torch.Tensor]:
        """The fused kernel on the parameters it covers, plain tensors and the local shards of DTensors (a
        skipped step, ``ok`` False, leaves them untouched inside the kernel, without a host read); returns
        the parameters left to the plain path."""
        lr, momentum = group["lr"], group["momentum"]
        # Local steps (plain tensors, shards that hold whole rows or columns) in one call; shards whose rows
        # or columns are split over ranks (col on FSDP2's Shard(0)) per set of ranks that combine their sums.
        calls: dict = {}
        others = []
        for p in params:
            key = sharded.reduce_key(p, plan.geometry, plan.layout(p))
            if (self.master_weights and _low_precision(p)) or (key is not None and torch.compiler.is_compiling()):
                others.append(p)
            else:
                calls.setdefault(key, []).append(p)
        found_inf = None if ok is None else (~ok).to(torch.float32)
        args = (lr, momentum, group["nesterov"], group["weight_decay"])
        for key, mine in calls.items():
            bufs = [local(self._buffer(p, "momentum_buffer")) for p in mine] if momentum > 0 else None
            layouts = [sharded.global_layout(p, plan.layout(p)) for p in mine]  # factors from the global shape
            tensors = (plan.geometry, layouts, [local(p) for p in mine], [local(p.grad) for p in mine], bufs)
            if key is None:
                rest = fused_lmo_step_(*tensors, *args, found_inf)
            else:
                rest = fused_split_step_(*tensors, *args, sharded.reduce_over(key), found_inf)
            others += [mine[k] for k in rest]
        return others

    def _batched_spectral_step(self, plan: GroupPlan, group, targets, params, grads, directions, alpha, ok):
        """Same-shape matrices go through one batched Newton-Schulz (bmm) call: a transformer's identical
        matrices cost one call, not one each. The stack is a batch axis ``b`` of the layout."""
        momentum, nesterov = group["momentum"], group["nesterov"] and group["momentum"] > 0
        batches: dict[tuple, list[int]] = {}
        for k, (t, p) in enumerate(zip(targets, params)):
            batches.setdefault((t.shape, t.dtype, t.device, plan.layout(p)), []).append(k)
        for (_, _, _, layout), ks in batches.items():
            stack = []
            for k in ks:
                d = directions[k]
                if nesterov:
                    d = _finite(torch.lerp(grads[k], d, momentum), ok)
                elif momentum == 0 and ok is not None:  # a NaN would pass through the zero step size
                    d = torch.where(ok, d, d.new_zeros(()))
                stack.append(d)
            weights = torch.stack([targets[k] for k in ks])
            plan.geometry.apply_lmo_(weights, torch.stack(stack), alpha, as_layout("b" + layout.spec), self._workspace)
            torch._foreach_copy_([targets[k] for k in ks], list(weights.unbind(0)))

    def _adam_step(self, plan: GroupPlan, group, params, ok):
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        exp_avgs = [local(self._buffer(p, "exp_avg")) for p in params]
        exp_avg_sqs = [local(self._buffer(p, "exp_avg_sq")) for p in params]
        steps = [st["step"] for st in states]  # made by _init_group (dynamo replays a setdefault as a set)
        count = 1.0 if ok is None else ok.to(torch.float32)  # a skipped step is not counted
        for step in steps:
            step.add_(count)
        if _fused_adamw_applies(params, exp_avgs, exp_avg_sqs, self.master_weights):
            self._fused_adam_step(plan, group, params, exp_avgs, exp_avg_sqs, steps, ok)
            return
        # float32 math on float32 copies; the same expressions as torch.optim.AdamW with lr * c.
        targets = self._targets(params)
        shards = [local(t) for t in targets]
        grads = self._grads(params, ok, sanitize=True)
        ms, vs = _in_compute_dtype(exp_avgs), _in_compute_dtype(exp_avg_sqs)
        w1, b2 = _gate(ok, 1 - beta1, 0.0), _gate(ok, beta2, 1.0)
        for m, v, g in zip(ms, vs, grads):
            m.lerp_(g, w1 if ok is None else w1.to(m.dtype))
            v.mul_(b2).addcmul_(g, g, value=1 - beta2)
        _write_back(exp_avgs, ms)
        _write_back(exp_avg_sqs, vs)
        if wd:
            torch._foreach_mul_(shards, _gate(ok, 1 - lr * wd, 1.0))
        for t, p, m, v, step in zip(shards, params, ms, vs, steps):
            step = step.double()  # bias corrections in float64, as torch.optim.AdamW and the fused kernel
            step_size = _gate(ok, lr * plan.sign_scale(p), 0.0) / (1 - beta1**step)
            denom = torch.sqrt(v).div_(torch.sqrt(1 - beta2**step)).add_(eps)
            t.sub_(m.div(denom).mul_(step_size))
        _round_into(params, targets)

    def _fused_adam_step(self, plan: GroupPlan, group, params, exp_avgs, exp_avg_sqs, steps, ok):
        """torch's fused AdamW kernel, one call per sign factor c: lr*c, and decay wd/c so that the
        decay stays lr*wd. One pass over the tensors instead of about six; ``found_inf`` makes a skipped
        step return before touching anything."""
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        found_inf = None if ok is None else (~ok).to(torch.float32)
        by_scale: dict[float, list[list]] = {}
        for p, m, v, step in zip(params, exp_avgs, exp_avg_sqs, steps):
            lists = by_scale.setdefault(plan.sign_scale(p), [[], [], [], [], []])
            for bucket, t in zip(lists, (local(p), local(p.grad), m, v, step)):
                bucket.append(t)
        for c, (ps, gs, ms, vs, ss) in by_scale.items():
            torch._fused_adamw_(ps, gs, ms, vs, [], ss, amsgrad=False, lr=lr * c, beta1=beta1, beta2=beta2,
                                weight_decay=wd / c if wd else 0.0, eps=group["eps"], maximize=False,
                                grad_scale=None, found_inf=found_inf)

    def _init_group(self, first: dict) -> None:
        """Every state tensor the step will use, in every group, made before the step reads any. Under
        torch.compile, dynamo runs a method of this name eagerly, outside the graph (as for torch's
        optimizers; it wants a param group as the argument: ``first``, the first one with gradients). State
        made inside a graph can alias (inductor returned one buffer for the equal new step counters of
        several parameters), an attribute set there was lost between compiles (the skip counter), and state
        made by a second call was missing from dynamo's view of ``self.state``, so one call makes it all."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None and p.numel()]
            if self._skipped_device is None and params and group is first:  # where the step's flag will be
                self._skipped_device = torch.zeros((), dtype=torch.int64, device=local(params[0].grad).device)
            adam = group["update"] == "adam"
            keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",) * (group["momentum"] > 0)
            for p in params:
                for key in keys:
                    self._buffer(p, key)
                if adam:
                    self.state[p].setdefault("step", torch.zeros((), dtype=torch.float32, device=p.device))
            self._targets(params)  # master copies

    # --- precision -----------------------------------------------------------------------------------

    def _buffer(self, p: torch.Tensor, key: str) -> torch.Tensor:
        state = self.state[p]
        if key not in state:
            state[key] = torch.zeros_like(p, dtype=self._state_dtype_for(p), memory_format=torch.preserve_format)
        return state[key]

    def _state_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        return p.dtype if p.dtype == torch.float64 else self.state_dtype

    def _targets(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the step updates: the float32 master copy of a 16-bit parameter, or the parameter."""
        if not self.master_weights:
            return params
        out = []
        for p in params:
            if _low_precision(p):
                state = self.state[p]
                if "master" not in state:
                    state["master"] = p.detach().to(torch.float32, memory_format=torch.preserve_format)
                out.append(state["master"])
            else:
                out.append(p)
        return out

    def _grads(self, params, ok, sanitize: bool = False) -> list[torch.Tensor]:
        """The gradients in the compute dtype: float32 copies of 16-bit ones, with a skipped step's
        non-finite values zeroed on the way (``sanitize`` zeroes them in float32 gradients too)."""
        out = []
        for p in params:
            g = local(p.grad)
            if g.dtype != _compute_dtype(p):
                g = g.to(_compute_dtype(p)) if ok is None else torch.where(ok, g, 0.0).to(_compute_dtype(p))
            elif sanitize and ok is not None:
                g = torch.where(ok, g, 0.0)
            out.append(g)
        return out

    # --- non-finite values -------------------------------------------------------------------------

    def _lr_finite(self, work) -> bool:
        """A non-finite lr is known on the host: the step is skipped (or raises) without touching the device."""
        bad = []
        for gi, plan, group, _ in work:
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):  # a tensor lr is read once per step (a sync off the CPU)
                group["lr"] = lr = float(lr)
            if not math.isfinite(lr):
                bad.append(f"group {gi} ({group.get('role', plan.geometry)}) lr={lr}")
        if not bad:
            return True
        message = f"non-finite learning rate in {', '.join(bad)}"
        if self.nonfinite == "raise":
            raise FloatingPointError(message + "; weights and optimizer state are unchanged")
        warnings.warn(message + "; step skipped (see skipped_steps)", RuntimeWarning, stacklevel=3)
        self._skipped_host += 1
        return False

    def _flag_ok(self, work, found_inf: torch.Tensor) -> torch.Tensor:
        """The caller's verdict as the step's 0-d bool on the gradients' device (no pass over them)."""
        if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1:
            raise TypeError(f"found_inf must be a tensor with one element (nonzero: skip the step), got {found_inf!r}")
        device = local(work[0][3][0].grad).device
        ok = found_inf.reshape(()).to(device, non_blocking=True) == 0
        if self.nonfinite == "raise" and not bool(ok):  # the documented sync
            raise FloatingPointError("non-finite gradients (found_inf is set); weights and optimizer state are "
                                     "unchanged")
        return ok

    def _gradients_ok(self, work) -> torch.Tensor | None:
        """A 0-d bool on the device: every gradient is finite. None when ``nonfinite="ignore"``."""
        if self.nonfinite == "ignore":
            return None
        grads = [p.grad for *_, params in work for p in params]
        device = local(grads[0]).device
        shards = [local(g) for g in grads]
        plain = all(plain_tensor(g) for g in shards)
        if plain and self.kernel != "torch" and fused_ready(device) and all(g.dtype in KERNEL_DTYPES for g in shards):
            ok = all_finite(shards)  # one exact read-only pass in C++ (x * 0 is NaN only for NaN and inf)
        else:
            ok = _all_finite_foreach([g for g in shards if g.numel()], device)  # an uneven split can leave none
        # Shards of one tensor live on several ranks: AND the flag so every rank skips alike (on the device).
        ok = sharded.all_ranks(grads, ok)
        if self.nonfinite == "raise" and not bool(ok):  # the documented sync
            bad = [
                group["names"][k] if "names" in group else f"group {gi} param {k}"
                for gi, _, group, _ in work for k, p in enumerate(group["params"])
                if p.grad is not None and p.numel() and not bool(torch.isfinite(local(p.grad)).all())
            ]
            raise FloatingPointError(f"non-finite gradient in {len(bad)} tensor(s): {', '.join(bad[:5])}; "
                                     "weights and optimizer state are unchanged")
        return ok

    # --- state ---------------------------------------------------------------------------------------

    def state_dict(self):
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        skipped = int(state_dict.pop("skipped_steps", 0))
        _check_state_matches(self.param_groups, state_dict)  # before anything changes
        super().load_state_dict(state_dict)
        # torch casts every floating state tensor to its parameter's dtype; moments keep state_dtype and
        # master copies stay float32, so cast again from the saved tensors themselves.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                dtype = torch.float32 if key in ("master", "step") else self._state_dtype_for(p)
                self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)
        self._plans = [_plan_group(group) for group in self.param_groups]
        self.skipped_steps = skipped


def _name_of(group: dict, p: torch.Tensor) -> str:
    k = next(k for k, q in enumerate(group["params"]) if q is p)
    return group["names"][k] if "names" in group else f"params[{k}]"


class GroupPlan:
    """What the step needs of one param group: its geometry, parsed once, and each parameter's layout."""

    def __init__(self, geometry: Geometry, layouts: dict[int, Layout | None], shapes: dict[int, torch.Size]):
        self.geometry = geometry
        self._layouts = layouts  # by id(param)
        self._shapes = shapes  # by id(param): the shapes the layouts (and any state) were made for

    def layout(self, p: torch.Tensor) -> Layout | None:
        return self._layouts[id(p)]

    def check_shape(self, name, p: torch.Tensor) -> None:
        """A parameter reshaped since the optimizer took it (``p.data = ...``) would be stepped with the old
        shape's layout and momentum; ``name()`` gives its name for the error."""
        if p.shape != self._shapes[id(p)]:
            raise RuntimeError(
                f"{name()}: the parameter's shape changed from {tuple(self._shapes[id(p)])} to {tuple(p.shape)} "
                "since the optimizer took it, and its layout and optimizer state are for the old shape; build a "
                "new optimizer for the reshaped model (or load a state dict made for it)")

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
    shapes = {id(p): p.shape for p in group["params"]}
    for k, p in enumerate(group["params"]):
        name = group["names"][k] if "names" in group else f"params[{k}] of shape {tuple(p.shape)}"
        if not p.is_floating_point():
            raise ValueError(f"{name}: moga optimizers step real floating-point parameters, not {p.dtype} "
                             "(a complex parameter's imaginary part would be dropped)")
        try:
            # A plain matrix defaults to "oi"; non-matrix geometries have no layout.
            layouts[id(p)] = resolve_layout(group["layout"], p) if geometry.matrix else None
        except ValueError as e:
            if p.ndim < 2 and group["layout"] is None and "role" not in group:
                e = (f"the matrix geometry {geometry} does not apply to a {p.ndim}-D tensor (a bias or a norm "
                     "gain?): pass the model itself, so that its role plan gives vectors their own geometry")
            elif group["layout"] is None and "role" not in group:
                e = f"{e}; or pass the model itself, so that its role plan orients each parameter"
            raise ValueError(f"{name}: {e}") from None
        sharded.check_placements(name, p, geometry, layouts[id(p)])
        layouts[id(p)] = sharded.global_layout(p, layouts[id(p)])  # factors from the global shape
        if group["update"] == "adam" and geometry.sign_scale(p.shape, layouts[id(p)]) is None:
            raise ValueError(f"{name}: update='adam' needs a sign geometry, not {geometry}")
    return GroupPlan(geometry, layouts, shapes)


STATE_KEYS = {"lmo": {"momentum_buffer", "master"}, "adam": {"exp_avg", "exp_avg_sq", "step", "master"}}


def _check_state_matches(groups: list[dict], state_dict: Mapping) -> None:
    """A state dict from another optimizer or model is an error naming the first mismatch."""
    saved_groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
    if saved_groups is None or saved_state is None:
        raise ValueError("not an optimizer state dict: it needs 'state' and 'param_groups'")
    if len(saved_groups) != len(groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer {len(groups)}")
    for gi, (saved, group) in enumerate(zip(saved_groups, groups)):
        where = f"param group {gi}" + (f" ({group['role']})" if "role" in group else "")
        if saved.get("geometry") is None:
            raise ValueError(f"{where}: the state dict names no geometry: it is not a moga optimizer's state")
        for key in ("geometry", "update", "layout"):
            theirs = saved.get(key)
            if key == "geometry":
                theirs = str(parse_geometry(theirs))
            if theirs != group[key]:
                raise ValueError(f"{where}: the state dict's {key} is {theirs!r}, this optimizer's {group[key]!r}")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"{where}: the state dict has {len(saved['params'])} parameters, "
                             f"this optimizer {len(group['params'])}")
        for k, (i, p) in enumerate(zip(saved["params"], group["params"])):
            name = group["names"][k] if "names" in group else f"params[{k}]"
            for key, value in saved_state.get(i, {}).items():
                if key not in STATE_KEYS[group["update"]]:
                    raise ValueError(f"{where}, {name}: unexpected state {key!r} for update {group['update']!r}")
                if not torch.is_tensor(value):
                    raise ValueError(f"{where}, {name}: state {key!r} is not a tensor")
                expected = () if key == "step" else tuple(p.shape)
                if tuple(value.shape) != expected:
                    raise ValueError(f"{where}, {name}: state {key!r} has shape {tuple(value.shape)}, "
                                     f"expected {expected} (parameter shape {tuple(p.shape)})")
                _check_state_values(f"{where}, {name}", key, value)


def _check_state_values(where: str, key: str, value: torch.Tensor) -> None:
    """Loaded state no run can continue from: NaN or inf (a momentum NaN spreads over a whole row in one
    step), a negative second moment or step count. One read of each tensor, at load only."""
    shard = local(value)
    if not shard.numel():
        return
    low, high = (float(x) for x in torch.aminmax(shard.detach()))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"{where}: state {key!r} holds NaN or inf: the saved optimizer state is corrupt (the "
                         "next step would spread it over whole rows of weights); load an earlier checkpoint, or "
                         "this one's weights without its optimizer state")
    if key in ("exp_avg_sq", "step") and low < 0:
        raise ValueError(f"{where}: state {key!r} holds a negative value ({low:g}), which no step writes: "
                         "the saved optimizer state is corrupt")


LOW_PRECISION = (torch.float16, torch.bfloat16)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def _state_dtype(dtype: torch.dtype | str) -> torch.dtype:
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if resolved not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
    return resolved


def _low_precision(p: torch.Tensor) -> bool:
    return p.dtype in LOW_PRECISION


def _compute_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if _low_precision(p) else p.dtype


def _in_compute_dtype(state: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 copies of bfloat16 state (the same tensors otherwise); :func:`_write_back` stores them."""
    return [s.float() if s.dtype in LOW_PRECISION else s for s in state]


def _write_back(state: list[torch.Tensor], work: list[torch.Tensor]) -> None:
    for s, w in zip(state, work):
        if w is not s:
            s.copy_(w)


def _round_into(params: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """Master copies rounded into their 16-bit parameters (a skipped step rounds the same copy again)."""
    for p, t in zip(params, targets):
        if t is not p:
            p.copy_(t)


def _unscale_(grads: list[torch.Tensor], grad_scale: torch.Tensor) -> None:
    """Gradients times 1/grad_scale in place, that factor rounded as GradScaler rounds it; one foreach
    call per device and dtype."""
    inv = grad_scale.double().reciprocal().float()
    by_kind: dict = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), gs in by_kind.items():
        torch._foreach_mul_(gs, inv.to(device, non_blocking=True))


def _gate(ok: torch.Tensor | None, value: float, skipped: float):
    """``value``, or on the device ``value`` where ``ok`` else ``skipped``: in float64, so that a gated step
    size is the very number the ungated one would be (no host sync, no host-to-device copy)."""
    if ok is None:
        return value
    on = ok.to(torch.float64)
    return on * value + (1 - on) * skipped


def _finite(d: torch.Tensor, ok: torch.Tensor | None) -> torch.Tensor:
    """``d`` in place, zeroed on a skipped step (whose NaN would otherwise pass through a zero step size)."""
    return d if ok is None else torch.where(ok, d, d.new_zeros(()), out=d)


def _ema_(bufs: list[torch.Tensor], grads: list[torch.Tensor], weight: float, ok: torch.Tensor | None) -> None:
    """``bufs <- bufs + weight * (grads - bufs)``, untouched (bit for bit) on a skipped step."""
    if ok is None:
        torch._foreach_lerp_(bufs, grads, weight)
    elif _fused_sgd_applies(bufs, grads):
        # torch's fused SGD kernel steps W <- W - lr * (g + wd * W). With lr = -weight and wd = -1 that is
        # W + weight * (g - W), this EMA (the same bits as lerp), and found_inf makes it return before
        # touching anything: no pass to clean NaN out of the gradients.
        torch._fused_sgd_(bufs, grads, [], weight_decay=-1.0, momentum=0.0, lr=-weight, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False, grad_scale=None,
                          found_inf=(~ok).to(torch.float32))
    else:
        w = _gate(ok, weight, 0.0)
        for b, g in zip(bufs, grads):
            b.lerp_(torch.where(ok, g, 0.0), w.to(b.dtype))


def _dense(t: torch.Tensor) -> bool:
    """No gaps and no overlaps in memory: its elements fill one block, in some order of the dims."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_memory_order(*lists: list[torch.Tensor]) -> bool:
    """torch's fused kernels walk every tensor's memory as one flat array and ignore strides: they step
    element i of one tensor with element i of the others only when all are dense with the same strides
    (a transposed parameter, or a gradient assigned with other strides, would scramble the state)."""
    for tensors in zip(*lists):
        first = tensors[0]
        order = [s for s, n in zip(first.stride(), first.shape) if n > 1]
        if not _dense(first) or any(
                t.shape != first.shape or [s for s, n in zip(t.stride(), t.shape) if n > 1] != order
                for t in tensors[1:]):
            return False
    return True


def _all_finite_foreach(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-d bool on ``device``: no element is NaN or inf. torch's AMP check, one launch per device and dtype
    (it multiplies by exactly 1, so values stay bit for bit); tensors it cannot take (another device type,
    overlapping memory) by their min and max, where NaN and inf show up and nothing overflows."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    batches: dict = {}
    others = []
    for t in tensors:
        if t.device == device and device.type in ("cpu", "cuda") and _dense(t):
            batches.setdefault(t.dtype, []).append(t)
        else:
            others.append(t)
    if batches:
        one = torch.ones((), dtype=torch.float32, device=device)
        for batch in batches.values():
            torch._amp_foreach_non_finite_check_and_unscale_(batch, found, one)
    ok = found == 0
    if others:
        extremes = torch.cat([torch.stack(torch.aminmax(t)).to(device=device, dtype=torch.float64) for t in others])
        ok &= extremes.isfinite().all()
    return ok


def _fused_sgd_applies(bufs: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
    if not hasattr(torch, "_fused_sgd_") or torch.compiler.is_compiling():  # no fake kernel: compile can't trace it
        return False
    device, dtype = bufs[0].device, bufs[0].dtype
    return device.type in ("cpu", "cuda") and all(
        t.device == device and t.dtype == dtype and plain_tensor(t) for t in (*bufs, *grads)
    ) and _same_memory_order(bufs, grads)


def _fused_adamw_applies(params: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                         exp_avg_sqs: list[torch.Tensor], master_weights: bool) -> bool:
    """torch's fused AdamW kernel exists for these tensors: one CPU or CUDA device, one dtype for parameters,
    gradients and moments, one memory order. bfloat16 too (``state_dtype=torch.bfloat16``): the kernel does
    its math in float32, as the plain path does, but not with master copies, which it would bypass. Not under
    torch.compile, which cannot trace it on tensors it mutates functionally: there the plain path."""
    if not hasattr(torch, "_fused_adamw_") or torch.compiler.is_compiling():
        return False
    device, dtype = params[0].device, params[0].dtype
    allowed = (torch.float32, torch.float64) if master_weights else (torch.float32, torch.float64, torch.bfloat16)
    return (device.type in ("cpu", "cuda") and dtype in allowed
            and all(p.device == device and p.dtype == dtype and p.grad.dtype == dtype for p in params)
            and all(m.dtype == dtype for m in (*exp_avgs, *exp_avg_sqs))
            and _same_memory_order([local(p) for p in params], [local(p.grad) for p in params], exp_avgs, exp_avg_sqs))
