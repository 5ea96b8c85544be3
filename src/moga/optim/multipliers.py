"""Per-role learning-rate multipliers (muP's practice, and Muon users' Adam parts at their own rate).

``lr_multipliers={"readout": 0.5, "vector": 4}`` sets each of those roles' param groups to ``lr x multiplier``
at construction: the multiplied rate is the group's own ``lr``, the one every torch scheduler and moga's
training engine scale (they keep each group's ``initial_lr`` and multiply it), and ``state_dict`` saves it.
Each group also carries its ``lr_multiplier``, so the base rate stays readable (:func:`base_lr`). Weight
decay, ``W <- (1 - lr*wd) W``, follows the group's rate, as with any per-group lr in torch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from moga.roles import ROLES


def check_multipliers(multipliers: Mapping | None) -> dict[str, float]:
    """``{role: multiplier}`` with known roles and finite positive numbers, or a clear error."""
    if multipliers is None:
        return {}
    if not isinstance(multipliers, Mapping):
        raise ValueError(f"lr_multipliers must map roles to numbers, e.g. {{'readout': 0.5}}, got {multipliers!r}")
    out = {}
    for role, m in multipliers.items():
        if role not in ROLES:
            raise ValueError(f"lr_multipliers names role {role!r}, which is not a role; roles: {', '.join(ROLES)}")
        if isinstance(m, bool) or not isinstance(m, numbers.Real) or not math.isfinite(m) or m <= 0:
            raise ValueError(f"lr_multipliers[{role!r}] must be a finite number > 0, got {m!r}")
        out[role] = float(m)
    return out


def apply_multipliers(groups: list[dict] | None, lr: float, multipliers: Mapping | None) -> list[dict] | None:
    """Give each role-plan group ``lr_multiplier`` (1 unless named) and ``lr = lr x lr_multiplier``; ``groups``
    None stands for torch-style params, which have no roles.

    A multiplier for a role none of the groups has is an error: a readout multiplier on a model whose head
    is tied to its embedding (role ``tied``) would otherwise change nothing, silently.
    """
    multipliers = check_multipliers(multipliers)
    if not multipliers:
        return groups
    roles = [g.get("role") for g in groups or [{}]]
    if None in roles:
        raise ValueError("lr_multipliers apply to a model's roles: pass the nn.Module (or its RolePlan), not "
                         "param groups; with param groups, give each group its own 'lr'")
    absent = sorted(set(multipliers) - set(roles))
    if absent:
        raise ValueError(f"lr_multipliers names role(s) {', '.join(absent)}, which no parameter of this model has; "
                         f"its roles: {', '.join(dict.fromkeys(roles))}")
    for group in groups:
        m = multipliers.get(group["role"], 1.0)
        group["lr_multiplier"] = m
        group["lr"] = lr * m
    return groups


def base_lr(group: Mapping, key: str = "lr") -> float:
    """The rate a param group's multiplier scales: its ``lr`` (or ``initial_lr``...) over its ``lr_multiplier``
    (1 when it has none)."""
    return group[key] / group.get("lr_multiplier", 1.0)
