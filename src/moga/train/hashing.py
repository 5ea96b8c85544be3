"""A run config's hash, which names its run directory and lets a run resume only under the same config, and
what makes two hashes differ.

The hash counts what a run computes: keys that do not (:data:`UNHASHED`) and keys added since runs were stored,
at their defaults (:data:`LATER_KEYS`, :data:`HASHED_OPTIM_KEYS`), are left out, and MOGA's preset is replaced by
what it runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from moga.optim.multipliers import preset_options
from moga.optim.muon import MOGA_MUON, MUON_PRESETS, PUBLISHED

Config = Any  # a moga.train.config.RunConfig (which imports this module) or its dict


def _is_config(x) -> bool:
    """A RunConfig, not its dict (its module imports this one: a duck test, not isinstance)."""
    return hasattr(x, "to_dict") and not isinstance(x, Mapping)


# Keys that do not change what a run computes: a run may resume with other values for them (sections,
# or dotted keys: where FSDP2 keeps the shards between steps changes no number).
UNHASHED = ("name", "logging", "checkpoint", "train.offload", "train.branch_from")
# Keys added after runs were stored: left out of the hash while at their default, so those runs keep theirs.
LATER_KEYS = {"optim": {"step_rule": "lr", "smoothness": "max", "smoothness_every": 10, "matrices": None,
                        "fused": None, "lr_multipliers": None,
                        "geometries": None},
              "train": {"parallel": "auto", "precision": "fp32", "divergence_factor": 10.0},
              "schedule": {"decay_fraction": 0.2}}


# The optim keys of 2026-12-03: one added since (an option an optimizer gained) is left out of the hash while
# unset, so the runs stored before it keep theirs.
HASHED_OPTIM_KEYS = frozenset({
    "name", "lr", "weight_decay", "momentum", "nesterov", "betas", "eps", "fused", "p", "embedding_q", "vectors",
    "scale", "ns_steps", "ns_dtype", "layers", "overrides", "lr_multipliers", "preset", "geometries", "matrices",
    "nonfinite", "step_rule", "smoothness", "smoothness_every"})


def config_hash(cfg: Config) -> str:
    d = cfg.to_dict() if _is_config(cfg) else dict(cfg)
    if isinstance(d.get("optim"), Mapping):
        d["optim"] = {k: v for k, v in d["optim"].items() if k in HASHED_OPTIM_KEYS or v is not None}
    for key in UNHASHED:
        section, _, sub = key.partition(".")
        if not sub:
            d.pop(key, None)
        elif isinstance(d.get(section), Mapping):
            d[section] = {k: v for k, v in d[section].items() if k != sub}
    for section, defaults in LATER_KEYS.items():
        if isinstance(d.get(section), Mapping):
            d[section] = {k: v for k, v in d[section].items() if k not in defaults or v != defaults[k]}
    if isinstance(d.get("optim"), Mapping):
        d["optim"] = _resolve_preset(d["optim"])
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _resolve_preset(optim: Mapping) -> dict:
    """``optim`` with its preset's name replaced by what it computes (MOGA's): the preset's multipliers, when
    there are any, and the momentum that runs. So the hash follows the numbers: a run on the default preset gets
    a new hash when the default changes, and the paper's preset, whose momentum is plain, hashes as it always
    has. Under a preset with Nesterov momentum, ``nesterov`` is written as what runs: True, or None (unset) for
    plain momentum, the form of every config from before a preset set the momentum, so a run made then on the
    default (embedding tables at lr/16, plain momentum) resumes with ``optim.nesterov=false``."""
    optim = dict(optim)
    name = optim.pop("preset", None) or "default"
    if optim.get("name", "moga") == "muon":
        # what Muon runs: the published recipe unless the preset is moga's all-geometry Muon, which hashes as
        # every Muon run did before the published recipe became the default, so those runs resume with it
        if MUON_PRESETS.get(name, PUBLISHED) is not MOGA_MUON:
            optim["muon_preset"] = "published"
        return optim
    if optim.get("name", "moga") != "moga":
        return optim
    preset = preset_options(name)
    if preset.lr_multipliers:
        optim["preset_lr_multipliers"] = dict(preset.lr_multipliers)
    if preset.nesterov:
        optim["nesterov"] = True if optim.get("nesterov") in (None, True) else None
    if preset.hidden and "hidden" not in (optim.get("geometries") or {}):  # as MOGA applies it: the user's wins
        optim["geometries"] = {**(optim.get("geometries") or {}), "hidden": preset.hidden}
    return optim


def flatten_keys(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(flatten_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def hash_diff(stored: Config, now: Config, stored_hash: str | None = None) -> list[str]:
    """Why two configs hash apart: their differing keys, or, when none differs, the one input the hash resolves
    beyond the keys, MOGA's default preset, which changed since ``stored`` ran. With ``stored_hash`` (the hash
    the run was stored under), it names the setting that resumes the run, found by trying each: ``optim.preset=
    paper`` (a run from when the default was the papers' choice) or ``optim.nesterov=false`` (from when it was the
    embedding tables at lr/16 with plain momentum)."""
    diff = config_diff(stored, now)
    if diff:
        return diff
    optim = (now.to_dict() if _is_config(now) else dict(now)).get("optim") or {}
    if optim.get("name") == "muon":
        return [f"optim.preset: no key differs, but the hash counts which Muon runs, now {PUBLISHED.describe}; a run "
                f"made before that was the default ran {MOGA_MUON.describe}, and resumes with optim.preset=moga"]
    why = (f"optim.preset: no key differs, but the hash counts what MOGA's default preset runs, now "
           f"{preset_options('default').describe()}")
    if stored_hash is None:
        return [f"{why}; a run made under an earlier default resumes with optim.preset=paper (made when the default "
                f"was the papers' choice) or optim.nesterov=false (the embedding tables at lr/16, plain momentum)"]
    now = now.to_dict() if _is_config(now) else json.loads(json.dumps(now))
    for key, value, then in (("preset", "paper", "the papers' choice: every role at lr, plain momentum"),
                             ("nesterov", False, "the embedding tables at lr/16, plain momentum")):
        if config_hash({**now, "optim": {**now.get("optim", {}), key: value}}) == stored_hash:
            return [f"{why}; this run was made when the default was {then}, and resumes with "
                    f"optim.{key}={str(value).lower()}"]
    return [f"{why}; no setting of this version reproduces the run's hash (it ran an earlier default with its own "
            f"settings): start it again, or resume it with the moga version it ran under"]


def config_diff(a: Config, b: Config, *, hashed_only: bool = True) -> list[str]:
    """'key: a -> b' for every dotted key whose value differs."""
    fa, fb = (flatten_keys(x.to_dict() if _is_config(x) else x) for x in (a, b))
    keys = sorted(set(fa) | set(fb))
    if hashed_only:
        keys = [k for k in keys if k not in UNHASHED and k.split(".")[0] not in UNHASHED]
    return [f"{k}: {fa.get(k, '<unset>')!r} -> {fb.get(k, '<unset>')!r}" for k in keys if fa.get(k) != fb.get(k)]
