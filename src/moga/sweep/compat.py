"""Whether a sweep config extends the sweep a store holds: the same base config, spec and optimizers, on a
grid that may differ (lr values, scales, exclusions, included cells). An optimizer's default is compared by
what it runs, from the stamps the store's definition keeps (``moga.optim.preset_history``): a default that
changed since the store was made refuses to mix the old cells with new ones under one name."""

from __future__ import annotations

import json

from moga.optim.preset_history import (
    describe_change, moga_default, moga_pin, moga_runs, muon_default, muon_runs, stamps
)
from moga.sweep.spec import Sweep, SweepSpec


# What an extension may change: the grid (axis values, exclusions) and how it is run and drawn.
EXTENSIBLE = {"name", "axes", "exclude", "include", "scale_key", "scale_keys", "early_stop_diverged", "heartbeat_timeout"}


def incompatible(stored: dict, sweep: Sweep) -> str | None:
    """Why ``sweep`` cannot extend the stored definition, or None when it only changes the grid."""
    base = json.loads(json.dumps(sweep.base))
    optimizers = _optimizers(sweep)
    why = _preset_changed(stored, sweep, optimizers == {"moga"}) if "moga" in optimizers else None
    if why is None and "muon" in optimizers:
        why = _muon_changed(stored, sweep)
    if why:
        return why
    # compared by what they run, above: MOGA's preset, and its momentum where every cell is MOGA
    keys = ("preset", "nesterov") if optimizers == {"moga"} else ("preset",)
    stored_base, base = _without(stored["base"], keys), _without(base, keys)
    if stored_base != base:
        changed = sorted(changed_keys(stored_base, base))
        return f"its base config changed: {', '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}"
    old = SweepSpec.model_validate(stored["spec"]).model_dump(mode="json")
    new = sweep.spec.model_dump(mode="json")
    if "muon" in optimizers:
        was, now = _muon_runs(stored, old), _muon_runs(sweep.to_dict(), new)
        if was != now:
            return f"its Muon cells ran {was.describe}, and would now run {now.describe}"
    if _without_muon_preset(old["overrides"]) != _without_muon_preset(new["overrides"]):
        return "its overrides changed"
    for key in sorted(set(old) | set(new)):
        if key not in EXTENSIBLE and key not in ("base", "overrides") and old.get(key) != new.get(key):
            return f"its {key} changed"
    if set(old["axes"]) != set(new["axes"]):  # as sets: the stored copy has its keys sorted
        return f"its axes changed from {sorted(old['axes'])} to {sorted(new['axes'])}"
    for key, values in new["axes"].items():
        was = old["axes"][key]
        if isinstance(was, dict) and isinstance(values, dict) and "by" in was and was.get("by") != values.get("by"):
            return f"axis {key} now depends on {values.get('by')!r}, not {was.get('by')!r}"
    return None


def _muon_changed(stored: dict, sweep: Sweep) -> str | None:
    """A store from before the published recipe became Muon's default (it records none) ran moga's all-geometry
    Muon in its Muon cells: refused where a Muon cell would now run the published one."""
    was = muon_default(stored)
    if was == muon_default(stamps()):
        return None
    if all(o.preset == was for o in sweep.optims("optim.name", "optim.preset") if o.name == "muon"):
        return None
    return ("Muon's default became the published recipe (AdamW on tables, head and vectors) since it was stored, "
            f"and its finished Muon cells ran moga's all-geometry Muon (optim.preset: {was} on every Muon cell runs "
            "what they ran)")


def _muon_preset_override(overrides: dict) -> str | None:
    """The preset a dependent override ``optim.preset: {by: optim.name, values: {muon: NAME}}`` gives Muon's cells
    alone, else None."""
    dep = overrides.get("optim.preset")
    if isinstance(dep, dict) and dep.get("by") == "optim.name" and set(dep.get("values", {})) == {"muon"}:
        return dep["values"]["muon"]
    return None


def _without_muon_preset(overrides: dict) -> dict:
    """The overrides but Muon's preset, which is compared by what it runs (:func:`_muon_runs`)."""
    return {k: v for k, v in overrides.items() if k != "optim.preset" or _muon_preset_override(overrides) is None}


def _muon_runs(definition: dict, spec: dict):
    """What a sweep definition's Muon cells run (outside an optim.preset axis): the preset its overrides give
    them, else its base's, under the defaults the definition stamped."""
    return muon_runs(_muon_preset_override(spec["overrides"]) or _optim(definition["base"], "preset", None),
                     definition)


def _optimizers(sweep: Sweep) -> set[str]:
    """The optimizers the sweep's cells run, from one config per distinct optim.name cell value."""
    return {optim.name for optim in sweep.optims("optim.name")}


def _without(base: dict, keys: tuple[str, ...]) -> dict:
    optim = base.get("optim")
    return {**base, "optim": {k: v for k, v in optim.items() if k not in keys}} if isinstance(optim, dict) else base


def _preset_changed(stored: dict, sweep: Sweep, only_moga: bool) -> str | None:
    """For a sweep with MOGA cells, the base's optim.preset and optim.nesterov are compared by what they run,
    MOGA's lr multipliers and momentum, not by name: pinning "paper" on a sweep stored while the default was the
    paper's extends it, and so does pinning ``optim.nesterov: false`` (where every cell is MOGA) on one stored while
    the default's momentum was plain. When the default has changed since the sweep was stored, its finished MOGA
    cells on the default ran the old one: refused."""
    was_default, default = moga_default(stored), moga_default(stamps())
    old, new = moga_runs(_section(stored["base"]), was_default), moga_runs(_section(sweep.base), default)
    if old != new:
        keys = [k for k in ("preset", "nesterov") if _optim(stored["base"], k) != _optim(sweep.base, k)]
        if keys:
            return f"its base config changed: {', '.join('optim.' + k for k in keys)} ({describe_change(old, new)})"
        pin = "".join(f" (optim.{k}: {str(v).lower() if isinstance(v, bool) else v} in its base runs what they ran)"
                      for k, v in (moga_pin(old, new, only_moga) or {}).items())
        return (f"MOGA's default preset changed since it was stored ({describe_change(old, new)}), and its base "
                f"runs the default: its finished MOGA cells ran the old one{pin}")
    if was_default != default and any(v in (None, "default") for v in _axis_values(sweep, "optim.preset")):
        return (f"MOGA's default preset changed since it was stored ({describe_change(was_default, default)}), "
                f"and its optim.preset axis runs 'default'")
    return None


def _section(base: dict) -> dict:
    optim = base.get("optim")
    return optim if isinstance(optim, dict) else {}


def _optim(base: dict, key: str, unnamed="default"):
    value = _section(base).get(key)
    return (value or unnamed) if key == "preset" else value


def _axis_values(sweep: Sweep, key: str) -> list:
    return [cell[key] for cell in sweep.cells if key in cell]


def changed_keys(a, b, prefix: str = "") -> list[str]:
    """The dotted keys at which two nested config dicts differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in set(a) | set(b) for k in changed_keys(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]
