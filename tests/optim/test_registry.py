"""The registry reads each optimizer's config keys off its signature, and the classes declare the options
they share once (moga.optim.options): a new option or optimizer is one declaration."""

import inspect

import pytest
import torch

from moga.optim import MOGA, GeometryOptimizer, Muon, ScaledAdamW
from moga.optim.options import SHARED_DEFAULTS, SharedOptions
from moga.optim.registry import NOT_CONFIG_KEYS, OPTIMIZERS, signature_keys

from .tinynet import TINY_OVERRIDES, TinyNet

CLASSES = {"moga": MOGA, "muon": Muon, "adamw-scaled": ScaledAdamW}


def test_every_key_is_a_config_field_and_every_config_field_an_optimizer_takes_is_a_key():
    config = pytest.importorskip("moga.train.config")  # the training config needs the CLI's extras
    fields = set(config.OptimConfig.model_fields)
    for name, entry in OPTIMIZERS.items():
        assert entry.keys <= fields, (name, entry.keys - fields)
    for name, cls in CLASSES.items():
        takes = {p for p in inspect.signature(cls).parameters} | set(SharedOptions.__annotations__)
        own = {"matrices"} if name == "moga" else set()  # the builder's own key
        assert OPTIMIZERS[name].keys == ((takes & fields) - NOT_CONFIG_KEYS) | own, name


def test_the_classes_declare_only_what_differs():
    shared = set(SharedOptions.__annotations__)
    assert set(SHARED_DEFAULTS) == shared
    base = inspect.signature(GeometryOptimizer).parameters
    assert all(base[k].default == v for k, v in SHARED_DEFAULTS.items())  # the base takes them all, declared once
    for cls in CLASSES.values():
        own = inspect.signature(cls).parameters
        assert "options" in own and own["options"].kind is inspect.Parameter.VAR_KEYWORD
        assert not (set(own) - {"betas", "eps"}) & shared, cls  # ScaledAdamW keeps torch's (lr, betas, eps) order
    assert signature_keys(MOGA) == OPTIMIZERS["moga"].keys - {"matrices"}


def test_shared_options_reach_the_optimizer_and_a_fixed_one_is_refused():
    for cls in CLASSES.values():
        opt = cls(TinyNet(), overrides=TINY_OVERRIDES, nonfinite="raise", state_dtype="bfloat16",
                  master_weights=True, kernel="torch", betas=(0.8, 0.9), eps=1e-6)
        assert (opt.nonfinite, opt.state_dtype, opt.master_weights, opt.kernel) == (
            "raise", torch.bfloat16, True, "torch")
        assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in opt.param_groups)
    for cls, fixed in [(ScaledAdamW, "momentum"), (ScaledAdamW, "update"), (Muon, "geometry"), (MOGA, "update"),
                       (MOGA, "nonfinite_policy")]:  # fixed by the class (Adam keeps its own moments), or unknown
        with pytest.raises(TypeError, match=f"{cls.__name__}.*'{fixed}'"):
            cls(TinyNet(), overrides=TINY_OVERRIDES, **{fixed: "x"})
