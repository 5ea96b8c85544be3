"""The one optimizer loop behind MOGA, Muon and rescaled AdamW: each param group names a geometry.

A group's ``update`` is ``"lmo"`` (steepest descent: ``D* = lmo(G)`` on the momentum EMA ``G``) or
``"adam"`` (Adam's ``m_hat / (sqrt(v_hat) + eps)`` in place of ``sign(G)`` in a sign geometry, with
that geometry's factor). Every step is ``W <- (1 - lr*wd) W + lr * D*`` (docs/math.md §1.4, §3.1), written
out in :mod:`moga.optim.functional`; this class keeps the param groups and their state and hands each group
to a fused kernel (:mod:`moga.optim.fused`) or to functional's plain path.

Each group's geometry is parsed once, when the group is added (and again when a state dict is loaded),
into a :class:`~moga.geometry.Geometry` and the layout of each parameter; ``step`` uses those. The group
keeps the spec string, layout and update as plain strings only so that they survive ``state_dict`` and
``torch.load``'s ``weights_only`` mode; nothing is stored on tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.optim import Optimizer

from moga.geometry import Geometry, parse_geometry
from moga.kernels import check_kernel, covers, fused_available
from moga.optim import fused, nonfinite, precision, sharded, whole
from moga.optim.functional import adam_steps_, average_, lmo_step_
from moga.optim.groups import GroupPlan, check_state_matches, name_of, plan_group
from moga.optim.multipliers import apply_multipliers
from moga.optim.nonfinite import check_policy
from moga.optim.options import (
    SHARED_DEFAULTS,
    check_hyperparameters,
    warn_if_decay_diverges,
    warn_if_trainer_arguments_ignored,
)
from moga.optim.sharded import local
from moga.roles import RolePlan, build_plan
from moga.workspace import Workspace

__all__ = ["GeometryOptimizer", "warn_if_decay_diverges"]
_D = SHARED_DEFAULTS


def _pick(ks: list[int], *lists: list | None) -> list:
    """Each of ``lists`` (None stays None) at the indices ``ks``."""
    return [None if xs is None else [xs[k] for k in ks] for xs in lists]


class GeometryOptimizer(Optimizer):
    """Steepest descent with a geometry per param group.

    ``params`` is an ``nn.Module`` (its role plan is built with ``role_geometries``), a
    :class:`~moga.roles.RolePlan`, or torch-style params / param groups; a group without a ``geometry``
    key takes ``geometry`` and ``update``. With a model or a plan, the vector role's groups (biases, norm
    gains, scalars) are not decayed, as in Trainer's and nanoGPT's optimizers. ``lr_multipliers={"readout": 0.5, ...}`` (a model or plan only)
    sets each named role's groups to ``lr`` times its multiplier (:mod:`moga.optim.multipliers`); they override,
    role by role, the defaults of a preset (MOGA's ``preset=``) and of the model's kind (a contrastive model's).
    ``print(opt.plan)`` shows each parameter's multiplier.

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
    preset: str | None = None  # a named set of defaults, lr multipliers and momentum (MOGA's, moga.optim.multipliers)
    preset_multipliers: Mapping[str, float] = {}

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = _D["betas"],
        eps: float = _D["eps"],
        *,
        geometry: Geometry | str | None = None,
        update: str = "lmo",
        geometries: Mapping[str, str] | None = _D["geometries"],
        overrides: Mapping | None = _D["overrides"],
        lr_multipliers: Mapping[str, float] | None = _D["lr_multipliers"],
        nonfinite: str = _D["nonfinite"],
        state_dtype: torch.dtype | str = _D["state_dtype"],
        master_weights: bool = _D["master_weights"],
        distributed: bool | None = _D["distributed"],
        kernel: str = _D["kernel"],
    ):
        nonfinite = check_policy(nonfinite)
        self.kernel = check_kernel(kernel)
        self.state_dtype = precision.state_dtype(state_dtype)
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
        if self.plan is not None or lr_multipliers:  # each role's group at lr x its multiplier (moga.optim.multipliers)
            # defaults: the preset's (MOGA), then a contrastive model's (moga.roles); the user's win role by role
            kind = {**self.preset_multipliers, **(self.plan.lr_multipliers if self.plan is not None else {})}
            params = apply_multipliers(params if self.plan is not None else None, defaults["lr"], lr_multipliers, kind)
            if self.plan is not None and self.preset is not None:
                for group in params:
                    group["preset"] = self.preset  # kept with the group's lr by schedulers and state_dict
        self.nonfinite = nonfinite
        self.distributed = distributed  # split whole-matrix work across ranks for plain tensors (see Muon)
        self._skipped_host = 0  # skips known on the host (a non-finite lr)
        self._skipped_device: torch.Tensor | None = None  # skips flagged on the device, read lazily
        self._workspace = Workspace()  # scratch for temporaries; not state, never saved
        self._plans: list[GroupPlan] = []  # per param group: its geometry and layouts; never saved
        super().__init__(params, defaults)
        warn_if_decay_diverges(self.param_groups)
        warn_if_trainer_arguments_ignored(self, lr, weight_decay)
        self._show_multipliers()
        # Build or load the fused kernel now (once per process), not inside a step that may be compiled.
        for device in {p.device for plan, group in zip(self._plans, self.param_groups)  # a DTensor's: its shard's
                       if group["update"] == "lmo" and covers(plan.geometry) for p in group["params"]}:
            fused_available(self.kernel, device)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self._plans.append(plan_group(self.param_groups[-1]))
        except Exception:
            self.param_groups.pop()  # a rejected group leaves the optimizer as it was
            raise

    def _show_multipliers(self) -> None:
        """``print(opt.plan)`` shows each role's lr multiplier and the steepest-descent groups' momentum as the
        groups hold them (a copy of the plan: one plan may serve several optimizers)."""
        if self.plan is not None:
            lrs = {g["role"]: g.get("lr_multiplier", 1.0) for g in self.param_groups if "role" in g}
            self.plan = self.plan.with_multipliers(lrs, self.preset, self._momentum_in_words())

    def _momentum_in_words(self) -> str | None:
        """E.g. "EMA 0.9, Nesterov" for the lmo groups (Adam's groups have their betas), None without any."""
        words, adam = {}, {}
        for g in self.param_groups:
            if g["update"] == "lmo":
                kind = "Nesterov" if g["nesterov"] else "plain"
                words.setdefault(f"EMA {g['momentum']:g}, {kind}" if g["momentum"] > 0 else "none", []).append(
                    g.get("role", "?"))
            else:  # the Adam groups' momentum is their betas; where the plan says 'vector', a step without factor
                adam.setdefault(f"AdamW, betas ({g['betas'][0]:g}, {g['betas'][1]:g})", []).append(g.get("role", "?"))
        if len(words) <= 1 and not adam:
            return next(iter(words), None)
        if len(words) <= 1:
            said = list(words)
        else:
            said = [f"{', '.join(dict.fromkeys(roles))}: {w}" for w, roles in words.items()]
        return "; ".join(said + [f"{', '.join(dict.fromkeys(roles))}: {w}" for w, roles in adam.items()])

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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._work()
        if not work:
            return loss
        if not nonfinite.lr_finite(work, self.nonfinite):
            self._skipped_host += 1
            return loss
        replicated = sharded.replicated_world(self.distributed)
        for _, plan, _, _ in work:  # refused before anything changes
            sharded.check_stateful_split(plan.geometry, replicated)
        gate = self._gate(work, found_inf, grad_scale)
        jobs: list[whole.WholeJob] = []  # whole-matrix steps, split among ranks after every group's own
        rounding = []
        for _, plan, group, params in work:
            if group["update"] == "adam":
                self._adam_step(plan, group, params, gate)
                continue
            params = self._fused_lmo_step(plan, group, params, gate)
            if not params:
                continue
            # What is left (spectral, p = inf, master copies, kernel="torch", CUDA shards split over ranks)
            # steps here, DTensor parameters on their local shards (moga.optim.sharded).
            ok = None if gate is None else gate.ok  # made here: a step the kernels cover needs only gate.skip
            targets = precision.master_targets(self.state, params, self.master_weights)
            rounding.append((params, targets))
            targets = [local(t) for t in targets]
            grads, layouts = precision.compute_grads(params, ok), [plan.layout(p) for p in params]
            bufs = [local(self.state[p]["momentum_buffer"]) for p in params] if group["momentum"] > 0 else None
            hyper = dict(lr=group["lr"], momentum=group["momentum"], nesterov=group["nesterov"])
            mine, theirs = whole.split(plan.geometry, layouts, params, replicated)
            if theirs:
                jobs += whole.steps_(plan.geometry, *_pick(theirs, layouts, params, targets, grads, bufs), **hyper,
                                     weight_decay=group["weight_decay"], ok=ok, workspace=self._workspace,
                                     split_replicated=replicated)
            if not mine:
                continue
            ms = average_(*_pick(mine, targets, grads, bufs), lr=group["lr"], momentum=group["momentum"],
                          weight_decay=group["weight_decay"], ok=ok)
            hyper["lr"] = nonfinite.gate(ok, group["lr"], 0.0)  # 0 on a skipped step: a no-op in every geometry
            for i, k in enumerate(mine):  # the one-tensor step of moga.optim.functional, as written there
                lmo_step_(targets[k], grads[k], None if ms is None else ms[i], geometry=plan.geometry,
                          layout=layouts[k], **hyper, averaged=True, ok=ok, workspace=self._workspace,
                          reduce=sharded.reducer(params[k], plan.geometry, layouts[k]),
                          moment=self.state[params[k]]["row_moment"] if plan.stateful else None)
        whole.step_jobs(jobs)
        for params, targets in rounding:
            precision.round_into(params, targets)
        if gate is not None:
            self._skipped_device.add_(gate.skip.to(self._skipped_device.device))
        return loss

    def _gate(self, work, found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None) -> nonfinite.Gate | None:
        """The step's non-finite verdict, after every state tensor is made and the gradients are unscaled."""
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        self._init_group(self.param_groups[work[0][0]])  # every group's state, in one call (see there)
        if grad_scale is not None:
            precision.unscale_([local(p.grad) for *_, params in work for p in params], grad_scale)
        if found_inf is None:
            ok = nonfinite.gradients_ok(work, self.nonfinite, self.kernel)
            return None if ok is None else nonfinite.Gate(~ok, ok)
        # the caller's verdict: no pass over the gradients, and only the ops the step's paths need
        return nonfinite.Gate(nonfinite.flag_skip(work, found_inf, self.nonfinite))

    def _fused_lmo_step(self, plan: GroupPlan, group: dict, params: list, gate: nonfinite.Gate | None) -> list:
        """The fused kernel on the group's tensors it covers; returns the parameters left to the plain path."""
        if not (covers(plan.geometry) and fused_available(self.kernel, local(params[0]).device)):
            return params
        bufs = [self.state[p]["momentum_buffer"] for p in params] if group["momentum"] > 0 else None
        return fused.lmo_group_(plan, group, params, bufs, None if gate is None else gate.skip, self.master_weights)

    def _work(self) -> list[tuple]:
        """(index, plan, group, parameters to step) of each group with gradients; bad gradients raise here."""
        work = []
        for gi, (plan, group) in enumerate(zip(self._plans, self.param_groups)):
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.layout != torch.strided for p in params):
                raise RuntimeError("moga optimizers do not support sparse gradients")
            params = [p for p in params if p.numel()]  # a zero-size parameter has nothing to step
            for p in params:
                sharded.check_grad(lambda: name_of(group, p), p)
                plan.check_shape(lambda: name_of(group, p), p)
            if params:
                work.append((gi, plan, group, params))
        return work

    def _adam_step(self, plan: GroupPlan, group, params, gate: nonfinite.Gate | None):
        exp_avgs = [local(self.state[p]["exp_avg"]) for p in params]
        exp_avg_sqs = [local(self.state[p]["exp_avg_sq"]) for p in params]
        steps = [self.state[p]["step"] for p in params]  # made by _init_group (dynamo replays a setdefault as a set)
        count = 1.0 if gate is None else gate.ok.to(torch.float32)  # a skipped step is not counted
        for step in steps:  # not _foreach_add_: its CUDA kernel reads a tensor count on the host
            step.add_(count)
        if fused.adam_applies(params, exp_avgs, exp_avg_sqs, self.master_weights):
            fused.adam_group_(plan, group, params, exp_avgs, exp_avg_sqs, steps, None if gate is None else gate.found)
            return
        ok = None if gate is None else gate.ok
        targets = precision.master_targets(self.state, params, self.master_weights)
        adam_steps_([local(t) for t in targets], precision.compute_grads(params, ok, sanitize=True), exp_avgs,
                    exp_avg_sqs, steps, [plan.sign_scale(p) for p in params], lr=group["lr"], betas=group["betas"],
                    eps=group["eps"], weight_decay=group["weight_decay"], ok=ok)
        precision.round_into(params, targets)

    def _init_group(self, first: dict) -> None:
        """Every state tensor the step will use, in every group, made before the step reads any. Under
        torch.compile, dynamo runs a method of this name eagerly, outside the graph (as for torch's
        optimizers; it wants a param group as the argument: ``first``, the first one with gradients). State
        made inside a graph can alias (inductor returned one buffer for the equal new step counters of
        several parameters), an attribute set there was lost between compiles (the skip counter), and state
        made by a second call was missing from dynamo's view of ``self.state``, so one call makes it all."""
        for plan, group in zip(self._plans, self.param_groups):
            params = [p for p in group["params"] if p.grad is not None and p.numel()]
            if self._skipped_device is None and params and group is first:  # where the step's flag will be
                self._skipped_device = torch.zeros((), dtype=torch.int64, device=local(params[0].grad).device)
            adam = group["update"] == "adam"
            keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",) * (group["momentum"] > 0)
            for p in params:
                for key in keys:
                    self._buffer(p, key)
                if plan.stateful and not adam:  # NorMuon's per-row second moment (moga.geometry.SpectralRow)
                    self.state[p].setdefault("row_moment", torch.zeros(
                        plan.state_shape(p), dtype=self._state_dtype_for(p), device=p.device))
                if adam:
                    self.state[p].setdefault("step", torch.zeros((), dtype=torch.float32, device=p.device))
            precision.master_targets(self.state, params, self.master_weights)  # master copies

    def _buffer(self, p: torch.Tensor, key: str) -> torch.Tensor:
        state = self.state[p]
        if key not in state:
            state[key] = torch.zeros_like(p, dtype=self._state_dtype_for(p), memory_format=torch.preserve_format)
        return state[key]

    def _state_dtype_for(self, p: torch.Tensor) -> torch.dtype:
        return p.dtype if p.dtype == torch.float64 else self.state_dtype

    # --- state ---------------------------------------------------------------------------------------

    def state_dict(self):
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        skipped = int(state_dict.pop("skipped_steps", 0))
        check_state_matches(self.param_groups, state_dict)  # before anything changes
        super().load_state_dict(state_dict)
        # torch casts every floating state tensor to its parameter's dtype; moments keep state_dtype and
        # master copies stay float32, so cast again from the saved tensors themselves.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                dtype = torch.float32 if key in ("master", "step") else self._state_dtype_for(p)
                self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)
        self._plans = [plan_group(group) for group in self.param_groups]
        self.skipped_steps = skipped
        self._show_multipliers()  # the saved groups brought their own multipliers
