"""The model and the optimizer a config names.

Model: one of ``moga.models.MODELS`` or your own ``package.module:factory``, called with the model
section's extra keys plus what the data decides (input size, classes, vocabulary) when the
constructor takes them. ``depth_scaling: inverse_depth`` then sets every residual branch's scale to
``alpha = k_base / K`` (or ``beta / K``) with ``moga.depth``, K being the model's ``depth``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os

import torch
from torch import nn

from moga.depth import residual_alpha, scale_residual_branches
from moga.models import GPT, MODELS, FeedForward, GPTConfig, SharedWeightsNet
from moga.optim.registry import OPTIMIZERS

from .config import ConfigError, RunConfig


# --- model ---------------------------------------------------------------------------------------

def imports_refused() -> bool:
    """MOGA_NO_IMPORT (set by --no-import): a config may name only registered models, data and optimizers."""
    return os.environ.get("MOGA_NO_IMPORT", "").strip().lower() not in ("", "0", "false", "no", "off")


def refuse_import(name: str, key: str, valid: str) -> None:
    """Under --no-import, a ``module:factory`` name is refused before anything is imported: every module can
    do harm when called with a config's arguments (``moga.train.checkpoint:save_checkpoint`` writes a file)."""
    if imports_refused():
        raise ConfigError(f"{key}={name!r} would import and call {name.partition(':')[2]!r} from "
                          f"{name.partition(':')[0]!r}; refused because imports are off (--no-import or "
                          f"MOGA_NO_IMPORT). Use a registered name ({valid}), or allow imports for a config "
                          "you trust")


def _registered_spelling(name: str):
    """The registered model that ``module:Class`` names exactly (moga.models:GPT), or None."""
    for cls in MODELS.values():
        if name in (f"moga.models:{cls.__name__}", f"{cls.__module__}:{cls.__qualname__}"):
            return cls
    return None


def model_factory(name: str):
    if ":" in name:
        module, _, attr = name.partition(":")
        registered = _registered_spelling(name)
        if registered is not None:
            return registered

        refuse_import(name, "model.name", ", ".join(MODELS))
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"model.name={name!r}: cannot import {attr} from {module} ({e})") from None

    if name not in MODELS:
        raise ConfigError(f"unknown model.name {name!r}; valid: {', '.join(MODELS)}, or 'package.module:factory'")
    return MODELS[name]


def factory_parameters(factory) -> list[str] | None:
    """Keyword arguments the factory takes (None: it takes any)."""
    if factory is GPT:  # GPT(**overrides) forwards them to its config dataclass
        return [f.name for f in dataclasses.fields(GPTConfig)]
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def model_kwargs(cfg: RunConfig, data_inputs: dict | None = None) -> dict:
    """The constructor arguments: the config's model keys, then what the data decides for the rest."""
    m = cfg.model
    factory = model_factory(m.name)
    accepted = factory_parameters(factory)
    kwargs = m.kwargs
    if accepted is not None:
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            own = [k for k in type(m).model_fields]
            raise ConfigError(f"unknown key(s) {', '.join('model.' + k for k in unknown)} for model {m.name!r}; "
                              f"valid keys: {', '.join(own + [a for a in accepted if a not in own])}")
    if m.depth_scaling != "none" and "alpha" in kwargs:
        raise ConfigError("give model.alpha or model.depth_scaling, not both")
    for k, v in (data_inputs or {}).items():
        if k not in kwargs and accepted is not None and k in accepted:
            kwargs[k] = v
    return kwargs


def model_from_config(cfg: RunConfig, data_inputs: dict | None = None, scale_depth: bool = True) -> nn.Module:
    """The configured model, its residual branches scaled (``scale_depth=False``: unscaled, the same
    parameters, for counting them without the probe forwards)."""
    m = cfg.model
    model = model_factory(m.name)(**model_kwargs(cfg, data_inputs))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name={m.name!r} returned a {type(model).__name__}, not an nn.Module")
    if m.depth_scaling != "none" and scale_depth:
        depth = getattr(model, "depth", None)
        alpha = residual_alpha(depth, m.depth_scaling, m.k_base, m.beta) if isinstance(depth, int) else None
        scale_residual_branches(model, alpha, depth=depth, mode=m.depth_scaling, k_base=m.k_base, beta=m.beta)
    return model


# --- optimizer -----------------------------------------------------------------------------------

def count_layers(model: nn.Module) -> int:
    """L for the adaptive step: the model's ``depth`` for the convergence paper's nets, else its weight layers."""
    if isinstance(model, (FeedForward, SharedWeightsNet)):
        return model.depth
    n = sum(isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)) for m in model.modules())
    if n == 0:
        raise ConfigError("cannot count the layers of this model: set optim.layers (L)")
    return n


def build_optimizer(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    entry = OPTIMIZERS[o.name]
    kw = {k: getattr(o, k) for k in entry.keys if getattr(o, k) is not None}
    lr = o.lr if o.lr is not None else entry.default_lr
    if lr is not None:
        kw["lr"] = lr
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    if "overrides" in entry.keys:  # the model's own overrides (e.g. a tied head), then the config's
        own = model.plan_overrides() if callable(getattr(model, "plan_overrides", None)) else {}
        kw["overrides"] = {**own, **kw.pop("overrides", {})} or None
    if "layers" in entry.keys and "layers" not in kw:
        kw["layers"] = count_layers(model)
    return entry.build(model, weight_decay=o.weight_decay, **kw)
