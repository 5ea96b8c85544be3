"""Per-role learning-rate multipliers (muP's practice, and Muon users' Adam parts at their own rate).

``lr_multipliers={"readout": 0.5, "vector": 4}`` sets each of those roles' param groups to ``lr x multiplier``
at construction: the multiplied rate is the group's own ``lr``, the one every torch scheduler and moga's
training engine scale (they keep each group's ``initial_lr`` and multiply it), and ``state_dict`` saves it.
Each group also carries its ``lr_multiplier``, so the base rate stays readable (:func:`base_lr`). Weight
decay, ``W <- (1 - lr*wd) W``, follows the group's rate, as with any per-group lr in torch.

MOGA's presets (:data:`PRESETS`) are named sets of defaults (:class:`Preset`): per-role multipliers, whether
momentum is Nesterov's, and the hidden matrices' geometry. ``MOGA(model, preset="paper")`` runs the width
paper's exact choice, every role at ``lr`` with plain EMA momentum; ``"default"`` is MOGA's default;
``"muoneq"`` is the default with MuonEq's ``row_spectral`` on the hidden matrices (a user's
``geometries={"hidden": ...}`` wins). A user's ``lr_multipliers`` override a
preset's role by role, and a preset's multiplier for a role the model does not have is skipped (a user's is an
error, see :func:`apply_multipliers`); a user's ``nesterov=True/False`` overrides the preset's.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

from moga.roles import ROLES


@dataclass(frozen=True)
class Preset:
    """What a MOGA preset sets: per-role lr multipliers (``{}``: every role at lr), Nesterov momentum, and the
    hidden matrices' geometry (None: MOGA's row(p))."""

    lr_multipliers: Mapping[str, float] = field(default_factory=dict)
    nesterov: bool = False
    hidden: str | None = None

    def to_dict(self) -> dict:
        """The JSON form a sweep store records (``moga_default_preset``)."""
        return {"lr_multipliers": dict(self.lr_multipliers), "nesterov": self.nesterov,
                **({"hidden": self.hidden} if self.hidden else {})}

    @classmethod
    def from_record(cls, record: Mapping | None) -> Preset:
        """A preset as a store recorded it: :meth:`to_dict`'s form; a plain ``{role: multiplier}`` dict, the
        form of stores from before presets set momentum (all ran plain momentum); None, a store from before any
        record (the default was then the paper's)."""
        if record is None:
            return PAPER
        if "nesterov" in record or "lr_multipliers" in record:
            return cls(dict(record.get("lr_multipliers") or {}), bool(record.get("nesterov", False)),
                       record.get("hidden"))
        return cls(dict(record), False)

    def describe(self) -> str:
        """E.g. "lr multipliers {'embedding': 0.0625}, Nesterov momentum"."""
        momentum = "Nesterov momentum" if self.nesterov else "plain momentum"
        hidden = f", hidden matrices {self.hidden}" if self.hidden else ""
        return f"lr multipliers {dict(self.lr_multipliers) or 'none'}, {momentum}{hidden}"


# The width paper's exact choice: no multipliers, every role steps at lr, with plain EMA momentum.
PAPER_MULTIPLIERS: dict[str, float] = {}
PAPER = Preset(PAPER_MULTIPLIERS, nesterov=False)
# MOGA's default. A default changes only where the ablation shows a gain larger than its interval at every width
# tested. The embedding tables at 1/16 of the lr beat the paper's 1 at every width measured, by far more than the
# seed spread (docs/results.md, "Quality against tuned baselines"). Nesterov momentum beat plain momentum, each at
# its own tuned lr, by 3.6% [2.8, 4.4], 3.7% [3.2, 4.1] and at least 3.4% [2.5, 4.4] at widths 64, 128, 256
# (800 steps), by 1.4% [0.1, 2.8] at width 64 with 4x the steps and by 1.0-2.2% at 100 steps (3 seeds each).
DEFAULT_MULTIPLIERS: dict[str, float] = {"embedding": 1 / 16}
DEFAULT = Preset(DEFAULT_MULTIPLIERS, nesterov=True)
# Beyond the paper: MuonEq's order on the hidden matrices (rows normalized, then orthogonalized; docs/math.md
# §2.9), MOGA's default elsewhere. Below the published Muon, each tuned, beyond the seed interval at every width
# measured (CPU 64-1024, one H200 512-2048), with its best rate 2^-5 at every width (docs/results.md, "Row-family
# hybrids against the published Muon").
MUONEQ = Preset(DEFAULT_MULTIPLIERS, nesterov=True, hidden="row_spectral")
PRESETS: dict[str, Preset] = {"default": DEFAULT, "paper": PAPER, "muoneq": MUONEQ}
PRESET_NAMES = tuple(PRESETS)


def preset_options(preset: str) -> Preset:
    """MOGA's preset ``preset``, or a clear error naming the presets."""
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(map(repr, PRESET_NAMES))} (\"paper\": the width paper's "
                         f"exact choice, every role at lr with plain momentum; \"default\": MOGA's default; "
                         f"\"muoneq\": the default with the hidden matrices' rows normalized, then orthogonalized), "
                         f"got {preset!r}")
    return PRESETS[preset]


def preset_multipliers(preset: str) -> dict[str, float]:
    """The lr multipliers of MOGA's preset ``preset`` (a copy), or a clear error naming the presets."""
    return dict(preset_options(preset).lr_multipliers)


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


def apply_multipliers(groups: list[dict] | None, lr: float, multipliers: Mapping | None,
                      defaults: Mapping[str, float] | None = None) -> list[dict] | None:
    """Give each role-plan group ``lr_multiplier`` (1 unless named) and ``lr = lr x lr_multiplier``; ``groups``
    None stands for torch-style params, which have no roles.

    ``multipliers`` are the user's: one for a role none of the groups has is an error (a readout multiplier on
    a model whose head is tied to its embedding, role ``tied``, would otherwise change nothing, silently).
    ``defaults`` (a preset's, a model kind's) apply to the roles that ``multipliers`` does not name, and only
    to roles the model has: a preset's embedding multiplier on a model without tables is not an error. With
    torch-style params there are no roles, so ``defaults`` do not apply (and ``multipliers`` are an error).
    """
    multipliers = check_multipliers(multipliers)
    roles = [g.get("role") for g in groups or [{}]]
    if None in roles:
        if multipliers:
            raise ValueError("lr_multipliers apply to a model's roles: pass the nn.Module (or its RolePlan), not "
                             "param groups; with param groups, give each group its own 'lr'")
        return groups  # no roles: a preset's or a model kind's defaults cannot apply
    absent = sorted(set(multipliers) - set(roles))
    if absent:
        raise ValueError(f"lr_multipliers names role(s) {', '.join(absent)}, which no parameter of this model has; "
                         f"its roles: {', '.join(dict.fromkeys(roles))}")
    multipliers = {**{r: m for r, m in check_multipliers(defaults).items() if r in roles}, **multipliers}
    if not multipliers:
        return groups
    for group in groups:
        m = multipliers.get(group["role"], 1.0)
        group["lr_multiplier"] = m
        group["lr"] = lr * m
    return groups


def base_lr(group: Mapping, key: str = "lr") -> float:
    """The rate a param group's multiplier scales: its ``lr`` (or ``initial_lr``...) over its ``lr_multiplier``
    (1 when it has none)."""
    return group[key] / group.get("lr_multiplier", 1.0)
