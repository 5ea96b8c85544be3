"""A model's width and depth knobs, and the ``moga train`` config that builds it at any (width, depth).

Three kinds of model: moga's own (``residual_mlp`` and ``feedforward``: ``width``, ``depth``; ``gpt`` and
``moga.integrations.llama:llama``: ``n_embd``, ``n_layer``, the heads following the width at a fixed head
dimension), a ``package.module:factory`` that takes ``width`` and ``depth``, and a Hugging Face config (a dict,
a ``PretrainedConfig`` or a JSON file) built by ``moga.integrations.llama:hf_causal_lm``, which keeps the head
dimension, the query heads per key-value head and the intermediate sizes' ratio to the hidden size.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moga.integrations.llama import HFScaleError, hf_head_dim, scale_hf_config
from moga.models import GPTConfig
from moga.train.build import factory_parameters, model_factory
from moga.train.config import ConfigError

HF_FACTORY = "moga.integrations.llama:hf_causal_lm"
GPT_NAMES = ("gpt", "moga.models:GPT", "moga.models.gpt:GPT")
LLAMA_NAMES = ("moga.integrations.llama:llama",)


class TuneError(ValueError):
    """Input that ``moga tune`` cannot work with; the message is one line saying what and why."""


@dataclass(frozen=True)
class Knobs:
    """Where a model section keeps its width and depth, what follows them, and which widths are valid."""

    width_key: str
    depth_key: str
    multiple: int = 1  # every width is a multiple of this (head dimension x query groups)
    head_dim: int | None = None  # the heads follow the width: n_head = width / head_dim
    head_key: str | None = None
    kind: str = "builtin"  # builtin, factory, hf
    notes: list[str] = field(default_factory=list)

    def keys(self, width: int, depth: int) -> dict[str, int]:
        """The model keys (without the ``model.`` prefix) that set this size."""
        out = {self.width_key: width, self.depth_key: depth}
        if self.head_key:
            out[self.head_key] = width // self.head_dim
        return out


def model_section(config_model: Mapping, model: Any) -> dict:
    """The training config's model section with ``model`` in it: None keeps the config's; a registered name or
    ``package.module:factory`` replaces its name (its keys stay when the name is the same); a Hugging Face
    config (a dict with ``hidden_size`` or ``model_type``, a ``PretrainedConfig``, a ``.json`` file) becomes an
    ``hf_causal_lm`` section."""
    section = dict(config_model)
    if model is None:
        return section
    hf = _hf_dict(model)
    if hf is not None:
        keep = {k: v for k, v in section.items() if k in ("depth_scaling", "k_base", "beta")}
        return {"name": HF_FACTORY, "config": hf, **keep}
    if not isinstance(model, str):
        raise TuneError(f"model must be a name, 'package.module:factory' or a Hugging Face config, "
                        f"got {type(model).__name__}")
    if section.get("name") == model:
        return section
    return {"name": model, **{k: v for k, v in section.items() if k in ("depth_scaling", "k_base", "beta")}}


def _hf_dict(model: Any) -> dict | None:
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):  # a transformers PretrainedConfig
        return json.loads(json.dumps(model.to_dict(), default=str))
    if isinstance(model, Mapping):
        if "hidden_size" in model or "model_type" in model or "n_embd" in model:
            return dict(model)
        raise TuneError(f"a model given as a mapping is a Hugging Face config (hidden_size, num_hidden_layers, "
                        f"...); this one has {', '.join(sorted(map(str, model))[:8])}")
    if isinstance(model, (str, Path)) and str(model).endswith(".json"):
        path = Path(model)
        if not path.is_file():
            raise TuneError(f"Hugging Face config {path} not found")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TuneError(f"{path} is not a JSON config ({e})") from None
        if not isinstance(data, dict):
            raise TuneError(f"{path} is not a JSON config: it holds a {type(data).__name__}")
        return data
    return None


def resolve_knobs(section: Mapping) -> Knobs:
    """The knobs of a model section; TuneError when the model has none moga can scale."""
    name = section.get("name", "residual_mlp")
    if name == HF_FACTORY:
        try:
            head_dim, group = hf_head_dim(dict(section.get("config") or {}))
        except HFScaleError as e:
            raise TuneError(str(e)) from None
        return Knobs("width", "depth", head_dim * group, kind="hf",
                     notes=[f"Hugging Face config: head_dim {head_dim} and {group} query heads per key-value head "
                            "kept, intermediate sizes in their ratio to the hidden size"])
    if name in GPT_NAMES:
        n_embd, n_head = section.get("n_embd", GPTConfig.n_embd), section.get("n_head", GPTConfig.n_head)
        head_dim = n_embd // n_head
        return Knobs("n_embd", "n_layer", head_dim, head_dim, "n_head",
                     notes=[f"GPT: head_dim {head_dim} kept (n_head follows n_embd)"])
    if name in LLAMA_NAMES:
        head_dim = section.get("head_dim", 32)
        if "n_head" in section:
            head_dim = section["n_embd"] // section["n_head"]
            return Knobs("n_embd", "n_layer", head_dim, head_dim, "n_head", notes=[f"head_dim {head_dim} kept"])
        return Knobs("n_embd", "n_layer", head_dim, notes=[f"head_dim {head_dim} kept"])
    try:
        accepted = factory_parameters(model_factory(name))
    except ConfigError as e:
        raise TuneError(str(e).splitlines()[0]) from None
    if accepted is not None and not {"width", "depth"} <= set(accepted):
        raise TuneError(f"model {name!r} has no width and depth knobs: moga tune scales a factory(width, depth, "
                        f"...); it takes {', '.join(accepted) or 'no arguments'}")
    return Knobs("width", "depth", kind="builtin" if ":" not in name else "factory")


def target_size(section: Mapping, knobs: Knobs, width: int | None, depth: int | None) -> tuple[int, int]:
    """The target (width, depth): given, else the model section's own (an HF config's hidden size and layers)."""
    own = dict(section.get("config") or {}) if knobs.kind == "hf" else dict(section)
    own_w = own.get("hidden_size" if knobs.kind == "hf" else knobs.width_key)
    own_d = own.get("num_hidden_layers" if knobs.kind == "hf" else knobs.depth_key)
    width, depth = width or own_w, depth or own_d
    if not (isinstance(width, int) and isinstance(depth, int)):
        raise TuneError("give the target size: --width and --depth (the config's model section sets neither)")
    if width % knobs.multiple:
        raise TuneError(f"target width {width} is not a multiple of {knobs.multiple} (head_dim x query groups): "
                        "its heads could not keep their size")
    if knobs.kind == "hf":
        try:
            scale_hf_config(section["config"], width, depth)
        except HFScaleError as e:
            raise TuneError(str(e)) from None
    return width, depth
