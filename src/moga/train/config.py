"""The typed schema of a training run, loaded from YAML or TOML plus ``key=value`` overrides.

Every section forbids unknown keys, so a typo is an error that lists the valid keys. The model
section is the exception: besides its own keys it takes the model's constructor arguments
(``model.width=256``), which are checked against the constructor when the model is built.
The config is saved with every checkpoint (nanoGPT's habit) and hashed: a run directory only
resumes under the same config.
"""

from __future__ import annotations

import difflib
import math
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, create_model,
                      field_validator, model_validator)

from moga.optim.multipliers import PRESET_NAMES
from moga.optim.muon import MUON_PRESET_NAMES
from moga.optim.nonfinite import POLICIES as NONFINITE_POLICIES
from moga.optim.registry import OPTIMIZER_NAMES, OPTIMIZERS, UNIT_STEP_OPTIMIZERS, config_options
from moga.geometry import SPECTRAL_SCALES, parse_geometry
from moga.roles import ADAM_PREFIX, ROLES
from moga.train.config_files import ConfigError, apply_overrides, read_config_file
from moga.train.hashing import config_hash



def single_path_component(name: str | None, what: str) -> str | None:
    """A name that becomes a directory under an output root: no separators, not '.' or '..', not absolute."""
    if name is None:
        return None
    if not name.strip() or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{what} {name!r} must be a single path component (a plain name without '/', "
                         "'..' or an absolute path); choose the output directory with --run-dir / --out")
    return name


def _keys(keys: list[str]) -> str:
    return f"{keys[0]} does not apply" if len(keys) == 1 else f"{', '.join(keys)} do not apply"


def _takes_bool(annotation) -> bool:
    if annotation is bool:
        return True
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(v, bool) for v in typing.get_args(annotation))
    return any(_takes_bool(a) for a in typing.get_args(annotation))


def _no_bool_for_numbers(cls, value, info: ValidationInfo):
    """pydantic reads true as 1 for an int or float key: train.steps=true would run one step."""
    if isinstance(value, bool) and info.field_name in cls.model_fields:
        if not _takes_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{str(value).lower()} is a boolean, which this key does not take (YAML also reads "
                             "yes/no/on/off as booleans)")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    _no_bool = field_validator("*", mode="before")(classmethod(_no_bool_for_numbers))


# --- sections ------------------------------------------------------------------------------------

SEED_MAX = 2**32 - 1  # numpy's range; streams derived from a seed (seed * 16 + k) stay within torch's 64 bits

IMAGE_DATA = ("digits", "fashion-mnist", "cifar10", "cifar100")
DATA_NAMES = (*IMAGE_DATA, "text", "synthetic")
_DATA_KEYS = {  # keys that only mean something for one kind of data
    "image": {"root", "val_size", "split_seed", "normalize", "augment", "flatten", "limit_per_class"},
    "text": {"text_path", "tokenizer", "data_dir", "block_size"},
    "synthetic": {"n_train", "n_val", "in_features", "out_features", "noise", "split_seed"},
}


class ModelConfig(BaseModel):
    """`name` picks the model; every other key not listed here is passed to its constructor."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str = Field("residual_mlp", description="residual_mlp, gpt, resnet, feedforward, shared_weights, "
                      "or 'package.module:factory' for your own model (called with the other keys)")
    depth_scaling: Literal["none", "inverse_depth"] = Field(
        "none", description="residual branch scale: none (alpha=1) or inverse_depth (alpha = k_base/K, or beta/K)")
    k_base: float = Field(2.0, gt=0, description="K_base in alpha = K_base/K (the depth paper uses 2)")
    beta: float | None = Field(None, gt=0, description="alpha = beta/K; overrides k_base when set")

    _no_bool = field_validator("*", mode="before")(classmethod(_no_bool_for_numbers))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The model's own constructor arguments."""
        return dict(self.model_extra or {})


class DataConfig(_Section):
    name: str = Field("digits", description="digits, fashion-mnist, cifar10, cifar100, text or synthetic")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="seed of batch order and augmentation "
                             "(default: the run seed)")
    # image datasets
    root: str | None = Field(None, description="images: directory (or tar) of the dataset files")
    val_size: int | float | None = Field(None, ge=0, description="images: validation count or fraction "
                                         "split off train (default: the loader's)")
    split_seed: int | None = Field(None, ge=0, le=SEED_MAX, description="images: seed of the train/val split; "
                                      "synthetic: seed of the data itself")
    normalize: str | None = Field(None, description="images: train, standard or none")
    augment: bool | None = Field(None, description="images: random crop and flip (default: the loader's)")
    flatten: bool | None = Field(None, description="inputs as vectors (default: yes for MLPs)")
    limit_per_class: int | None = Field(None, gt=0, description="cifar: keep the first N images per class and split")
    # text
    text_path: str | None = Field(None, description="text: UTF-8 file (default: $MOGA_TEXT or tiny Shakespeare)")
    tokenizer: Literal["char", "byte", "gpt2"] = Field("char", description="text: tokenizer")
    data_dir: str | None = Field(None, description="text: a prepared train.bin/val.bin directory "
                                 "(default: tokenize text_path into the cache)")
    block_size: int = Field(64, gt=0, description="text: context length")
    # synthetic teacher-student data
    n_train: int = Field(512, gt=0, description="synthetic: training samples")
    n_val: int = Field(128, gt=0, description="synthetic: validation samples")
    in_features: int = Field(16, gt=0, description="synthetic: input dimension")
    out_features: int = Field(1, gt=0, description="synthetic: targets (mse), labels (bce), classes (cross_entropy)")
    noise: float = Field(0.0, ge=0, description="synthetic: std of the noise added to regression targets")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        key = v.lower().replace("_", "-")
        key = {"fashionmnist": "fashion-mnist", "fmnist": "fashion-mnist", "cifar-10": "cifar10",
               "cifar-100": "cifar100"}.get(key, key)
        if key not in DATA_NAMES:
            raise ValueError(f"unknown data {v!r}; valid: {', '.join(DATA_NAMES)}")
        return key

    @property
    def kind(self) -> str:
        return "image" if self.name in IMAGE_DATA else self.name

    @model_validator(mode="after")
    def _keys_fit_kind(self):
        foreign = {k for keys in _DATA_KEYS.values() for k in keys} - _DATA_KEYS[self.kind]
        # A saved config lists every key with its default; only a changed one is a mistake.
        defaults = type(self).model_fields
        bad = sorted(k for k in foreign & self.model_fields_set if getattr(self, k) != defaults[k].default)
        if bad:
            raise ValueError(f"{_keys(bad)} to {self.kind} data ({self.name})")
        return self


# The optimizer keys are declared by the optimizers' signatures (moga.optim.registry.config_options). The fields
# below add ranges, choices and help where a type says too little; a key that no field declares is made from its
# type (unset: the optimizer's default), so an option added to an optimizer is a config key and a command-line
# override at once. Every optimizer accepts optim.preset: MOGA and Muon have presets, and a reproduction config
# pins one for all it sweeps.
_OPTIONS = config_options()
_OPTIONAL_OPTIM_KEYS = frozenset(_OPTIONS) - {"preset"}
_RUN_KEYS = frozenset({"name", "lr", "weight_decay", "step_rule", "smoothness", "smoothness_every"})  # not options


class _OptimFields(_Section):
    name: Literal[OPTIMIZER_NAMES] = Field(  # type: ignore[valid-type]
        "moga", description=", ".join(f"{e.name} ({e.description})" for e in OPTIMIZERS.values()))
    lr: float | None = Field(None, ge=0, description="peak learning rate (adaptive-gd: its alpha); "
                             "default: the optimizer's")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (sgd: L2)")
    momentum: float | None = Field(None, ge=0, lt=1, description="the EMA's beta")
    nesterov: bool | None = Field(None, description="unset: moga its preset's, muon on, sgd off")
    betas: tuple[float, float] | None = Field(None, description="Adam betas (moga: on vectors; muon: its AdamW parts, "
                                              "unset: its preset's)")
    eps: float | None = Field(None, gt=0, description="Adam eps")
    fused: bool | None = Field(None, description="torch's fused kernel (unset: torch's default, on the CPU its "
                               "per-tensor loop)")
    p: float | None = Field(None, ge=1, description="the row geometry's p")
    embedding_q: float | None = Field(None, ge=1, description="the embedding geometry's q (muon: preset moga)")
    vectors: Literal["adamw", "sign"] | None = Field(None, description="update of biases and gains")
    scale: Literal[SPECTRAL_SCALES] | None = Field(  # type: ignore[valid-type]
        None, description="the orthogonalized step's factor, match_rms_adamw (0.2 sqrt(max(m, n)), "
        "Moonlight's; unset: the preset's), torch (torch.optim.Muon's default sqrt(max(1, m/n))) or mean (sqrt(m/n))")
    ns_steps: int | None = Field(None, gt=0, description="Newton-Schulz steps")
    ns_dtype: str | None = Field(None, description="Newton-Schulz dtype (auto, float32, bfloat16; unset: "
                                 "bfloat16 under scale torch, else auto)")
    layers: int | None = Field(None, ge=1, description="L, the number of layers (default: from the model)")
    overrides: dict[str, str | dict[Literal["role", "layout", "geometry"], str]] | None = Field(
        None, description="role-plan overrides {parameter glob: role}, or {parameter glob: {geometry: spec}} (also "
        "role, layout), e.g. {'*.attn.*.weight': {geometry: spectral}}: the orthogonalized step on attention only")
    lr_multipliers: dict[Literal[ROLES], Annotated[float, Field(gt=0, strict=True)]] | None = Field(  # type: ignore[valid-type]
        None, description="{role: factor} on lr per role (embedding, readout, vector, ...); "
        "sweepable as optim.lr_multipliers.ROLE")
    preset: Literal[PRESET_NAMES + MUON_PRESET_NAMES] | None = Field(  # type: ignore[valid-type]
        None, description="moga: a named set of defaults, lr multipliers per role (which optim.lr_multipliers "
        "override role by role) and Nesterov momentum (which optim.nesterov overrides): paper (the width paper's exact "
        "choice, every role at lr, plain momentum), default (unset: MOGA's default) or muoneq (the default with "
        "row_spectral on the hidden matrices). muon: published (unset: the "
        "published recipe, AdamW on tables, head and vectors) or moga (moga's all-geometry Muon); MOGA's names run "
        "Muon's default. Other optimizers have one behaviour, which every name denotes; sweepable as optim.preset")
    geometries: dict[Literal[ROLES], str] | None = Field(  # type: ignore[valid-type]
        None, description="{role: geometry spec} in place of the optimizer's, e.g. readout: sign, "
        "or adam:sign (Adam's direction with the sign geometry's 1/fan_in); sweepable as optim.geometries.ROLE")
    matrices: str | None = Field(None, description="the geometry of input, hidden and conv matrices in "
                                 "place of row(p), e.g. 'col(q=2)' (the width paper's column normalization); "
                                 "the readout keeps row(p)")
    nonfinite: Literal[NONFINITE_POLICIES] | None = Field(  # type: ignore[valid-type]
        None, description="non-finite gradients (and adaptive-gd's loss)")
    step_rule: Literal["lr", "depth_paper"] = Field(
        "lr", description="lr: the schedule's rate; depth_paper (moga, muon, adamw-scaled): "
        "lr_t = min(schedule lr, ||grad||_block,* / L), the depth paper's eta* = ||grad||_*/L, so optim.lr is a cap")
    smoothness: Annotated[float, Field(gt=0)] | Literal["max", "ema"] = Field(
        "max", description="depth_paper: L, a measured block smoothness (a number), or a running estimate from the "
        "trajectory smoothness on a probe batch: max (the largest seen) or ema (beta 0.9; it drifts down, "
        "see moga.train.diagnostics)")
    smoothness_every: int = Field(10, gt=0, description="depth_paper, running L: measure it every N steps "
                                  "(two extra forward-backward passes each)")

    @field_validator("geometries")
    @classmethod
    def _geometry_specs(cls, geometries):
        for role, spec in (geometries or {}).items():
            parse_geometry(spec.removeprefix(ADAM_PREFIX))  # a bad spec is a config error, before any run
        return geometries

    @model_validator(mode="after")
    def _keys_fit_optimizer(self):
        keys = OPTIMIZERS[self.name].keys
        bad = sorted((_OPTIONAL_OPTIM_KEYS - keys) & {k for k in self.model_fields_set
                                                            if getattr(self, k) is not None})
        if bad:
            raise ValueError(f"{_keys(bad)} to optimizer {self.name}; it reads "
                             f"{', '.join(sorted(keys)) or 'no optional keys'}")
        if self.name == "moga" and self.preset in MUON_PRESET_NAMES:
            raise ValueError(f"optim.preset {self.preset!r} is Muon's; MOGA's presets: {', '.join(PRESET_NAMES)}")
        if self.name == "adaptive-gd" and self.weight_decay:
            raise ValueError("adaptive-gd is plain gradient descent: weight_decay must be 0")
        if self.step_rule == "lr":
            rule_keys = [k for k in ("smoothness", "smoothness_every")
                         if k in self.model_fields_set and getattr(self, k) != type(self).model_fields[k].default]
            if rule_keys:
                raise ValueError(f"{_keys(rule_keys)} to step_rule 'lr' (set optim.step_rule=depth_paper)")
        elif self.name not in UNIT_STEP_OPTIMIZERS:
            raise ValueError(f"step_rule depth_paper needs unit steps in a norm: optimizer "
                             f"{', '.join(UNIT_STEP_OPTIMIZERS)}, not {self.name}")
        return self


def _config_type(kind) -> object:
    """A signature's type as pydantic validates it, or Any where it cannot (a torch.dtype)."""
    try:
        TypeAdapter(kind)
        return kind
    except Exception:
        return Any


def _optim_section() -> type[_OptimFields]:
    """The optim section: the declared fields, a field for every other optimizer option, and each option's
    help led by the optimizers that read it. A declared field no optimizer reads is an error here."""
    declared = _OptimFields.model_fields
    stale = sorted(set(declared) - set(_OPTIONS) - _RUN_KEYS)
    if stale:
        raise TypeError(f"optim fields that no optimizer's signature takes: {', '.join(stale)}")
    made = {key: (_config_type(kind) | None, Field(None)) for key, (kind, _) in _OPTIONS.items() if key not in declared}
    cls = create_model("OptimConfig", __base__=_OptimFields, __module__=__name__, **made)  # type: ignore[call-overload]
    for key, field in cls.model_fields.items():
        if key in _OPTIONS:
            readers = ", ".join(_OPTIONS[key][1])
            field.description = f"{readers}: {field.description}" if field.description else readers
    cls.model_rebuild(force=True)
    return cls


OptimConfig = _optim_section()


class ScheduleConfig(_Section):
    name: Literal["constant", "cosine", "warmup_constant", "wsd"] = Field(
        "constant", description="constant, cosine (linear warmup then cosine to min_lr_ratio), warmup_constant, "
        "wsd (warmup, stable at the peak, linear decay to min_lr_ratio over the last decay_fraction)")
    warmup_steps: int | None = Field(None, ge=0, description="warmup length in steps")
    warmup_fraction: float | None = Field(None, ge=0, lt=1, description="warmup as a fraction of all steps")
    warmup_epochs: float | None = Field(None, ge=0, description="warmup length in epochs")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine, wsd: final lr / peak lr")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: the decay's share of the run")

    @model_validator(mode="after")
    def _one_warmup(self):
        given = [k for k in ("warmup_steps", "warmup_fraction", "warmup_epochs") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one warmup length, not {' and '.join(given)}")
        if given and self.name == "constant":
            raise ValueError("schedule 'constant' has no warmup: use 'warmup_constant' or 'cosine'")
        if "decay_fraction" in self.model_fields_set and self.name != "wsd" and self.decay_fraction != 0.2:
            raise ValueError(f"schedule.decay_fraction applies to schedule 'wsd', not {self.name!r}")
        return self


class TrainSection(_Section):
    steps: int | None = Field(None, gt=0, description="optimizer steps (or give epochs)")
    epochs: float | None = Field(None, gt=0, description="passes over the training split (or give steps)")
    batch_size: int | Literal["full"] = Field(128, description="samples (text: sequences) per optimizer step, "
                                              "over all processes; 'full' for full-batch gradient descent")
    grad_accum: int = Field(1, gt=0, description="micro-batches per step (batch_size must divide evenly)")
    loss: Literal["auto", "cross_entropy", "mse", "bce"] = Field(
        "auto", description="auto: cross_entropy for images and text, mse for synthetic data")
    loss_ceiling: float | None = Field(None, gt=0, description="a training loss above this ends the run "
                                       "as diverged (a non-finite loss always does)")
    divergence_factor: float | None = Field(
        10.0, gt=1, description="a training loss above this many times the first step's loss ends the run as "
        "diverged, with no tuning per task (null: off; loss_ceiling still applies)")
    grad_clip: float | None = Field(None, gt=0, description="clip the global gradient norm to this")
    device: str = Field("auto", description="auto (cuda if available), cpu, cuda, mps")
    compile: bool | str = Field(False, description="torch.compile the model: true, or a backend name")
    deterministic: bool = Field(False, description="torch.use_deterministic_algorithms during the run")
    parallel: Literal["auto", "none", "ddp", "fsdp"] = Field(
        "auto", description="several processes (torchrun): ddp (DistributedDataParallel) or fsdp (FSDP2, sharded "
        "parameters, gradients, optimizer state and checkpoints); none: one process; auto: ddp under torchrun")
    offload: bool = Field(
        False, description="under fsdp: keep the sharded parameters, gradients and optimizer state in CPU memory "
        "(FSDP2's CPUOffloadPolicy); the optimizer steps there, in moga's fused C++ kernel where it applies")
    branch_from: str | None = Field(
        None, description="start from this checkpoint (checkpoint-<step>.pt, kept by checkpoint.keep) of a run of "
        "this config at another length whose rates agree up to it: a cooldown branched from a warmup-stable-decay "
        "run; the numbers are this run's own (moga.train.branch)")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: autocast to bfloat16 (CPU and CUDA); under fsdp, bfloat16 parameters in "
        "compute with float32 gradient reductions and float32 weights in the optimizer")

    @field_validator("batch_size")
    @classmethod
    def _positive(cls, v):
        if v != "full" and v <= 0:
            raise ValueError("batch_size must be > 0 or 'full'")
        return v

    @model_validator(mode="after")
    def _length(self):
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give one of train.steps and train.epochs, not both (set the other to null)")
        return self


class EvalConfig(_Section):
    every: int | Literal["epoch"] = Field(0, description="evaluate every N steps, or every 'epoch' "
                                          "(0: only at the end)")
    split: Literal["val", "test"] = Field("val", description="held-out split to evaluate")
    batch_size: int | None = Field(None, gt=0, description="evaluation batch (default: the training micro-batch)")
    max_batches: int | None = Field(None, gt=0, description="cap on evaluation batches (default: the whole "
                                    "split for images and synthetic data, 20 for text)")
    train_eval: bool = Field(True, description="also evaluate the training split (no augmentation; same cap)")
    final_window: int | Literal["epoch"] = Field(
        "epoch", description="steps averaged into final_train_loss: 'epoch' (the last epoch) or a count")


    @field_validator("every")
    @classmethod
    def _non_negative(cls, v):
        if v != "epoch" and v < 0:
            raise ValueError("eval.every must be >= 0 or 'epoch'")
        return v


class CheckpointConfig(_Section):
    every: int = Field(500, ge=0, description="save every N steps (0: only at the end); saves are atomic")
    save_final: bool = Field(True, description="keep a checkpoint of the final model")
    keep: list[Annotated[int, Field(gt=0)]] = Field(
        default_factory=list, description="also keep the checkpoint of these steps, as checkpoint-<step>.pt: "
        "the points a warmup-stable-decay cooldown branches from (train.branch_from)")


class LoggingConfig(_Section):
    log_every: int = Field(10, gt=0, description="write a training record (and progress line) every N steps")
    diagnostics_every: int = Field(0, ge=0, description="per-layer diagnostics every N steps and at step 1 "
                                   "(0: off): update norm, gradient dual norm and ||W|| in each layer's geometry, "
                                   "trajectory smoothness; two extra forward-backward passes each. "
                                   "Plot: moga smoothness diagnostics RUN_DIR")
    alignment_every: int = Field(0, ge=0, description="every N steps (0: off), one 'alignment' record of the "
                                 "hidden matrices' momentum: how close row normalization is to "
                                 "orthogonalization (moga.smoothness.alignment); reads the optimizer's state only")
    progress: bool = Field(True, description="print the progress line")
    tensorboard: bool = Field(False, description="also log to TensorBoard (needs the tensorboard package)")
    wandb: bool = Field(False, description="also log to Weights & Biases (needs wandb; offline unless "
                        "WANDB_MODE says otherwise)")
    wandb_project: str = Field("moga", description="W&B project name")


class RunConfig(_Section):
    """One training run. Sections: model, data, optim, schedule, train, eval, checkpoint, logging."""

    seed: int = Field(0, ge=0, le=SEED_MAX, description="seeds model init, batch order and dropout")
    name: str | None = Field(None, description="a label for the run (not part of the config hash)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str | None) -> str | None:
        return single_path_component(v, "name")

    @model_validator(mode="after")
    def _has_length(self):
        if self.train.steps is None and self.train.epochs is None:
            raise ValueError("train: give the run's length, train.steps or train.epochs")
        if self.train.offload and self.train.parallel != "fsdp":
            raise ValueError(f"train.offload=true offloads FSDP2 shards: it needs train.parallel=fsdp, "
                             f"got {self.train.parallel!r}")
        if self.train.parallel == "fsdp":
            unsupported = [k for k, on in (("logging.diagnostics_every", self.logging.diagnostics_every),
                                           ("logging.alignment_every", self.logging.alignment_every),
                                           ("optim.step_rule=depth_paper", self.optim.step_rule != "lr"),
                                           ("optim.name=adaptive-gd", self.optim.name == "adaptive-gd"))
                           if on]
            if unsupported:
                raise ValueError(f"train.parallel=fsdp does not run {' or '.join(unsupported)} yet (they measure "
                                 "whole weights or the loss inside the step): use parallel=ddp")
        return self

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def hash(self) -> str:
        return config_hash(self)


# --- loading: the files themselves are read by moga.train.config_files ------------------------------

# section name -> its model class, e.g. "optim" -> OptimConfig
_SECTIONS = {name: f.annotation for name, f in RunConfig.model_fields.items()
             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}


def valid_keys(section: str | None) -> list[str]:
    if section is None:
        return list(RunConfig.model_fields)
    cls = _SECTIONS.get(section)
    return list(cls.model_fields) if cls else []


def _describe(error: dict) -> str:
    loc = [str(x) for x in error["loc"]]
    path = ".".join(loc)
    if error["type"] == "extra_forbidden":
        section = loc[0] if len(loc) > 1 else None
        keys = valid_keys(section)
        close = difflib.get_close_matches(loc[-1], keys, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        where = f"section {section!r}" if section else "the top level"
        return f"unknown key {path!r}{hint}; valid keys in {where}: {', '.join(keys)}"
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] in ("missing",):
        return f"{path}: required"
    if "input" in error and error["type"] not in ("value_error", "assertion_error"):
        return f"{path}: {msg} (got {error['input']!r})"
    return f"{path}: {msg}" if path else msg


def build_config(data: Mapping | None = None) -> RunConfig:
    """Validate a nested dict into a RunConfig; errors become one ConfigError naming every bad key."""
    try:
        return RunConfig.model_validate(dict(data or {}))
    except ValidationError as e:
        lines = sorted({_describe(err) for err in e.errors()})
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """The config in ``path`` (YAML, or TOML by suffix; None: all defaults) with ``key=value`` overrides."""
    data = read_config_file(path) if path is not None else {}
    return build_config(apply_overrides(data, overrides))


def as_config(config: RunConfig | Mapping | str | Path) -> RunConfig:
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, (str, Path)):
        return load_config(config)
    return build_config(config)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def json_float(x: float | None) -> float | None:
    """Floats for result files: inf stays inf (JSON 'Infinity', read back by Python), NaN becomes inf."""
    if x is None:
        return None
    return math.inf if math.isnan(x) else float(x)
