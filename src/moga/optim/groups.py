"""A param group as the step needs it, and its checks: the geometry parsed once and each parameter's layout
when the group is added, the saved state against the group when a state dict is loaded."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from moga.geometry import Geometry, parse_geometry
from moga.layout import Layout, resolve_layout
from moga.optim import sharded
from moga.optim.options import check_hyperparameters
from moga.optim.sharded import local


def name_of(group: dict, p: torch.Tensor) -> str:
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

    @property
    def stateful(self) -> bool:
        """The geometry keeps per-parameter state besides momentum (NorMuon's row second moment)."""
        return self.geometry.stateful

    def state_shape(self, p: torch.Tensor) -> tuple[int, ...] | None:
        layout = self.layout(p)
        return None if layout is None else self.geometry.state_shape(tuple(p.shape), layout)


def plan_group(group: dict) -> GroupPlan:
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


STATE_KEYS = {"lmo": {"momentum_buffer", "master", "row_moment"}, "adam": {"exp_avg", "exp_avg_sq", "step", "master"}}


def check_state_matches(groups: list[dict], state_dict: Mapping) -> None:
    """A state dict from another optimizer or model is an error naming the first mismatch."""
    saved_groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
    if saved_groups is None or saved_state is None:
        raise ValueError("not an optimizer state dict: it needs 'state' and 'param_groups'")
    if len(saved_groups) != len(groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer {len(groups)}")
    for gi, (saved, group) in enumerate(zip(saved_groups, groups)):
        geometry = parse_geometry(group["geometry"])
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
                expected = {"step": (), "row_moment": _state_shape(geometry, group, p)}.get(key, tuple(p.shape))
                if tuple(value.shape) != expected:
                    raise ValueError(f"{where}, {name}: state {key!r} has shape {tuple(value.shape)}, "
                                     f"expected {expected} (parameter shape {tuple(p.shape)})")
                check_state_values(f"{where}, {name}", key, value)


def _state_shape(geometry: Geometry, group: dict, p: torch.Tensor) -> tuple[int, ...] | None:
    """The shape of a stateful geometry's state for ``p`` (None: this geometry keeps none)."""
    if not geometry.matrix:
        return None
    shape = geometry.state_shape(tuple(p.shape), resolve_layout(group["layout"], local(p)))
    return None if shape is None else tuple(shape)


def check_state_values(where: str, key: str, value: torch.Tensor) -> None:
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
