"""What MOGA's and Muon's defaults were when a record was made, and what a config runs under them.

A default changes only on evidence (:mod:`moga.optim.multipliers`, :mod:`moga.optim.muon`), so a record made
before a change ran the old default: a sweep store that extended it on the new one would mix two optimizers
under one name. A record keeps today's defaults as stamps (:func:`stamps`); the functions below read a
stamp back, from this moga or an older one, and say what a config's ``optim`` section runs under it. The
sweep store keeps the stamps and compares what they say (``moga.sweep.compat``); the history lives here.

Stamps from older moga: no MOGA stamp, the paper's preset (the only default there was); a plain ``{role:
multiplier}``, those multipliers with plain momentum (:meth:`Preset.from_record`); no Muon stamp, moga's
all-geometry Muon (``"moga"``), Muon's default before the published recipe.
"""

from __future__ import annotations

from collections.abc import Mapping

from moga.optim.multipliers import PAPER, PRESETS, Preset, preset_options
from moga.optim.muon import MUON_DEFAULT, MUON_PRESETS, MuonPreset

MOGA_STAMP, MUON_STAMP = "moga_default_preset", "muon_default_preset"
MUON_BEFORE_STAMPS = "moga"  # what Muon's default ran in records without a Muon stamp


def stamps() -> dict:
    """Today's defaults, for a record to keep (MOGA's only where it is not the paper's, as older records)."""
    default = preset_options("default")
    return {**({MOGA_STAMP: default.to_dict()} if default != PAPER else {}), MUON_STAMP: MUON_DEFAULT}


def moga_default(record: Mapping) -> Preset:
    """MOGA's default when ``record`` was stamped (``stamps()`` for today's)."""
    return Preset.from_record(record.get(MOGA_STAMP))


def moga_runs(optim: Mapping | None, default: Preset) -> Preset:
    """What MOGA runs with the config section ``optim``: its preset (``default`` when it names none or
    "default") and its own ``nesterov``, if set."""
    optim = optim or {}
    name = optim.get("preset") or "default"
    preset = default if name == "default" else preset_options(name)
    nesterov = optim.get("nesterov")
    return Preset(dict(preset.lr_multipliers), preset.nesterov if nesterov is None else bool(nesterov), preset.hidden)


def moga_pin(ran: Preset, runs: Preset, nesterov_free: bool) -> dict | None:
    """The ``optim`` setting under which a config that now runs ``runs`` runs ``ran`` again: a named preset,
    else (where ``nesterov_free``: the setting reaches only MOGA) its momentum; None when no one setting does."""
    named = [name for name, preset in PRESETS.items() if name != "default" and preset == ran]
    if named:
        return {"preset": named[0]}
    if ran.lr_multipliers == runs.lr_multipliers and nesterov_free:
        return {"nesterov": ran.nesterov}
    return None


def describe_change(old: Preset, new: Preset) -> str:
    """E.g. "MOGA's momentum plain -> Nesterov" and/or "MOGA's lr multipliers {} -> {'embedding': 0.0625}"."""
    parts, was, now = [], dict(old.lr_multipliers), dict(new.lr_multipliers)
    if was != now:
        parts.append(f"MOGA's lr multipliers {was or 'none'} -> {now or 'none'}")
    if old.nesterov != new.nesterov:
        parts.append(f"MOGA's momentum {'Nesterov' if old.nesterov else 'plain'} -> "
                     f"{'Nesterov' if new.nesterov else 'plain'}")
    return ", ".join(parts)


def muon_default(record: Mapping) -> str:
    """The name of Muon's default preset when ``record`` was stamped."""
    return record.get(MUON_STAMP, MUON_BEFORE_STAMPS)


def muon_runs(preset: str | None, record: Mapping) -> MuonPreset:
    """What Muon runs with ``optim.preset`` ``preset`` under the defaults ``record`` stamped: MOGA's preset
    names (and none) are not Muon's, so they run Muon's default."""
    default = muon_default(record)
    return MUON_PRESETS.get(preset or default, MUON_PRESETS[default])
