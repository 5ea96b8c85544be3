"""A sweep config: a base training config and axes over any of its keys, expanded into cells.

```yaml
base: residual_mlp.yaml           # a training config (path relative to this file) or an inline mapping
overrides:                        # applied to the base for every cell
  train.steps: 300
  optim.preset: {by: optim.name, values: {muon: moga}}   # or to the cells with these values of an axis
axes:
  optim.name: [adamw, muon, moga]
  model.depth: [2, 8, 32]
  model.depth_scaling: [none, inverse_depth]
  optim.lr:                       # an axis that depends on another: each optimizer its own lr range
    by: optim.name
    values:
      adamw: {pow2: [-12, -7]}    # 2^-12 ... 2^-7
      muon: [0.01, 0.02, 0.04]
      moga: {pow2: [-6, -1]}
exclude:                          # cells matching every key of an entry are dropped
  - {optim.name: muon, model.depth: 32}
include:                          # cells run besides the grid: a grid cell with more keys (e.g. another seed)
  - {optim.name: moga, model.depth: 8, model.depth_scaling: none, optim.lr: 0.0625, seed: 1}
threads: 1                        # intra-op threads of every cell, whatever the number of workers
scale_key: model.depth            # the axis the report draws one curve per value of
# scale_keys: [model.width, model.depth]   # or two scale axes: a curve per pair and a regret heat map
```

Re-running a sweep whose grid grew (more lr values or scales, other exclusions, included cells such as
more seeds where a verdict is close) keeps every finished cell and runs only the new ones; a changed base
config or thread count is refused (``moga.sweep.compat``).

A cell's result does not depend on how many workers share the machine: every cell runs with ``threads``
intra-op threads (1 by default), since the thread count changes the order of floating-point reductions
and with it the losses.

A cell is the dict of its axis values; its id is a hash of that dict, so the same grid always maps to the
same run directories. A dependent override is not an axis: it sets a key on the cells it selects without
changing their ids (so a sweep can pin, say, Muon's preset and still resume the store it made before).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moga.optim.muon import MUON_DEFAULT, MUON_PRESETS
from moga.optim.preset_history import stamps
from moga.train.build import model_kwargs
from moga.train.config import build_config, single_path_component
from moga.train.config_files import ConfigError, apply_overrides, read_config_file, resolve_config_path


class SweepError(ValueError):
    """A sweep config that cannot run; raised before any cell starts."""


class DependentAxis(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(description="the axis whose value selects this axis' values")
    values: dict[str, Any] = Field(description="value of `by` -> list of values (or {pow2: [lo, hi]})")


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="a label for the sweep")
    base: str | dict = Field(description="the training config: a file (relative to the sweep file) or a mapping")
    overrides: dict[str, Any] = Field(default_factory=dict, description="dotted key -> value for every cell, or "
                                      "{by: AXIS, values: {axis value: value}} for the cells with those values")
    axes: dict[str, Any] = Field(description="dotted key -> values, or a dependent axis {by, values}")
    exclude: list[dict[str, Any]] = Field(default_factory=list, description="cells matching an entry are dropped")
    include: list[dict[str, Any]] = Field(default_factory=list, description="cells run besides the grid, each a "
                                          "grid cell plus keys that are not axes (e.g. seed)")
    threads: int = Field(1, ge=1, description="intra-op threads of every cell (fixed: results do not depend on "
                         "the number of workers)")
    scale_key: str = Field("model.depth", description="axis of model scale (one curve per value in the report)")
    scale_keys: list[str] | None = Field(None, description="two (or more) scale axes at once, e.g. [model.width, "
                                         "model.depth]: the report gives each pair a curve and a regret map; "
                                         "the first is scale_key")
    lr_key: str = Field("optim.lr", description="the learning-rate axis (x of the report's figures)")
    early_stop_diverged: bool = Field(False, description="skip a cell once a smaller lr of its row has diverged")
    heartbeat_timeout: float = Field(120.0, gt=0, description="seconds without a heartbeat before a claim is retaken")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str | None) -> str | None:
        return single_path_component(v, "the sweep name")

    @field_validator("axes")
    @classmethod
    def _axes_not_empty(cls, axes):
        if not axes:
            raise ValueError("a sweep needs at least one axis")
        return axes

    @model_validator(mode="after")
    def _primary_scale_key(self):
        if self.scale_keys is not None:
            if not self.scale_keys or len(set(self.scale_keys)) != len(self.scale_keys):
                raise ValueError(f"scale_keys must name distinct axes, got {self.scale_keys}")
            if "scale_key" in self.model_fields_set and self.scale_key != self.scale_keys[0]:
                raise ValueError(f"scale_key {self.scale_key!r} must be the first of scale_keys {self.scale_keys}")
            self.scale_key = self.scale_keys[0]
        return self

    @property
    def all_scale_keys(self) -> list[str]:
        return list(self.scale_keys or [self.scale_key])


# Each cell is a training run, and each is checked against the config schema before any runs (about a
# millisecond each): a grid larger than this is a mistake, refused with its size instead of checked for minutes.
MAX_CELLS = 10_000
POW2_MIN, POW2_MAX = -1074, 1023


def expand_values(values: Any, where: str) -> list:
    """A list of values, or ``{pow2: [lo, hi]}`` for 2^lo ... 2^hi (integer exponents)."""
    if isinstance(values, Mapping):
        if set(values) != {"pow2"} or not isinstance(values["pow2"], list) or len(values["pow2"]) != 2:
            raise SweepError(f"axis {where}: a range is written {{pow2: [lo, hi]}}, got {dict(values)!r}")
        lo, hi = values["pow2"]
        if not (isinstance(lo, int) and isinstance(hi, int)) or isinstance(lo, bool) or isinstance(hi, bool) \
                or lo > hi:
            raise SweepError(f"axis {where}: pow2 needs integers lo <= hi, got {values['pow2']!r}")
        if lo < POW2_MIN or hi > POW2_MAX:  # 2.0**1024 overflows a float
            raise SweepError(f"axis {where}: pow2 exponents must lie in [{POW2_MIN}, {POW2_MAX}] (finite floats), "
                             f"got {values['pow2']!r}")
        if hi - lo >= MAX_CELLS:
            raise SweepError(f"axis {where}: pow2 {values['pow2']!r} makes {hi - lo + 1} values; a sweep has at "
                             f"most {MAX_CELLS} cells")
        return [2.0**k for k in range(lo, hi + 1)]
    if not isinstance(values, list):
        raise SweepError(f"axis {where}: values must be a list, got {type(values).__name__}")
    if not values:
        raise SweepError(f"axis {where} is empty: give it at least one value")
    kinds = {_kind(v) for v in values} - {"null"}
    if len(kinds) > 1:
        raise SweepError(f"axis {where} mixes value types ({', '.join(sorted(kinds))}): {values!r}; "
                         "write every value the same way (numbers without quotes)")
    # 2 and 2.0 are one value to a run but two cells to the store: compare numbers by value.
    keys = [json.dumps(float(v) if _kind(v) == "number" else v, sort_keys=True) for v in values]
    if len(set(keys)) != len(values):
        raise SweepError(f"axis {where} repeats a value: {values!r}")
    return list(values)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "mapping"}.get(type(v), type(v).__name__)


def cell_id(params: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical(params).encode()).hexdigest()[:12]


def canonical(params: Mapping[str, Any]) -> str:
    """A cell's params as one string: equal exactly when the cells are (what its id hashes)."""
    return json.dumps(dict(params), sort_keys=True)


CELL_ID = re.compile(r"[0-9a-f]{12}")  # what cell_id makes: the only names a cell's run directory may have


class Sweep:
    """A validated sweep: its spec, base config and the expanded, ordered cells."""

    def __init__(self, spec: SweepSpec, base: dict, source: Path | None = None):
        self.spec = spec
        self.base = base
        self.source = source
        self.cells = self._expand()
        self._dependent_overrides = self._check_dependent_overrides()
        self._validate_cells()

    @classmethod
    def from_file(cls, path: str | Path) -> "Sweep":
        path = resolve_config_path(path)  # its base is read relative to where it really is
        data = read_config_file(path)
        return cls.from_dict(data, path.parent, source=path)

    @classmethod
    def from_dict(cls, data: Mapping, root: Path | None = None, source: Path | None = None) -> "Sweep":
        try:
            spec = SweepSpec.model_validate(dict(data))
        except ValidationError as e:
            lines = []
            for err in e.errors():
                loc = ".".join(str(x) for x in err["loc"])
                if err["type"] == "extra_forbidden":
                    lines.append(f"unknown sweep key {loc!r}; valid keys: {', '.join(SweepSpec.model_fields)}")
                else:
                    lines.append(f"{loc}: {err['msg']}")
            raise SweepError("invalid sweep config:\n  " + "\n  ".join(lines)) from None
        if isinstance(spec.base, str):
            base_path = Path(spec.base)
            if not base_path.is_absolute() and root is not None:
                base_path = root / base_path
            base = read_config_file(base_path)
        else:
            base = copy.deepcopy(spec.base)  # overrides below change nested dicts: never the caller's
        try:
            apply_overrides(base, [f"{k}={json.dumps(v)}" for k, v in spec.overrides.items() if not _is_dependent(v)])
        except ConfigError as e:
            raise SweepError(f"overrides: {e}") from None
        return cls(spec, base, source)

    # --- the grid ------------------------------------------------------------------------------------

    def _expand(self) -> list[dict]:
        axes = self.spec.axes
        plain = {k: expand_values(v, k) for k, v in axes.items() if not _is_dependent(v)}
        dependent = {}
        for key, raw in axes.items():
            if not _is_dependent(raw):
                continue
            try:
                dep = DependentAxis.model_validate(raw)
            except ValidationError as e:
                raise SweepError(f"axis {key}: a dependent axis is {{by: KEY, values: {{...}}}} ({e.errors()[0]['msg']})") from None
            if dep.by not in plain:
                raise SweepError(f"axis {key} depends on {dep.by!r}, which is not a plain axis of this sweep")
            by_values = {str(v) for v in plain[dep.by]}
            missing = by_values - set(dep.values)
            extra = set(dep.values) - by_values
            if missing or extra:
                raise SweepError(f"axis {key}: values must be given for exactly the values of {dep.by} "
                                 f"({sorted(by_values)}); missing {sorted(missing)}, unknown {sorted(extra)}")
            dependent[key] = (dep.by, {k: expand_values(v, f"{key}[{k}]") for k, v in dep.values.items()})

        size = math.prod(len(v) for v in plain.values()) * math.prod(
            max(len(v) for v in values.values()) for _, values in dependent.values())
        cells = []
        keys = list(plain)
        for combo in itertools.product(*(plain[k] for k in keys)):
            base_cell = dict(zip(keys, combo))
            dep_keys = list(dependent)
            dep_lists = [dependent[k][1][str(base_cell[dependent[k][0]])] for k in dep_keys]
            for dep_combo in itertools.product(*dep_lists):
                cell = {**base_cell, **dict(zip(dep_keys, dep_combo))}
                if not any(_matches(cell, ex) for ex in self.spec.exclude):
                    cells.append({k: cell[k] for k in axes})  # axis order as written
                    if len(cells) > MAX_CELLS:
                        shape = " x ".join(f"{len(v)} {k}" for k, v in plain.items())
                        made = f"up to {size} with the dependent axes" if dependent else f"{size}"
                        raise SweepError(f"the grid has more than {MAX_CELLS} cells: {shape} makes {made}. Each "
                                         "cell is a training run: split the sweep, or give the axes fewer values")
        for ex in self.spec.exclude:
            unknown = set(ex) - set(axes)
            if unknown:
                raise SweepError(f"exclude entry {ex!r} names {sorted(unknown)}, which are not axes")
        if not cells:
            raise SweepError("every cell is excluded: the sweep is empty")
        grid_keys = {cell_id(c) for c in cells}
        for extra in self.spec.include:
            if cell_id({k: extra.get(k) for k in axes}) not in grid_keys or set(extra) <= set(axes):
                raise SweepError(f"include entry {extra!r} must be a cell of the grid plus keys that are not axes "
                                 "(e.g. seed)")
            if cell_id(extra) not in grid_keys:
                cells.append(dict(extra))
                grid_keys.add(cell_id(extra))
        return cells

    def _check_dependent_overrides(self) -> dict[str, DependentAxis]:
        out = {}
        for key, raw in self.spec.overrides.items():
            if not _is_dependent(raw):
                continue
            try:
                dep = DependentAxis.model_validate(raw)
            except ValidationError as e:
                raise SweepError(f"overrides: {key} is {{by: AXIS, values: {{axis value: value}}}} "
                                 f"({e.errors()[0]['msg']})") from None
            if dep.by not in self.spec.axes or key in self.spec.axes:
                raise SweepError(f"overrides: {key} depends on {dep.by!r}, which must be an axis, and must not be "
                                 "an axis itself")
            out[key] = dep  # values for an axis value no cell has select nothing (a smaller grid may drop an arm)
        return out

    def _validate_cells(self) -> None:
        for cell in self.cells:
            try:
                model_kwargs(self.config(cell))  # also checks the model's own keys against its constructor
            except ConfigError as e:
                raise SweepError(f"cell {cell} does not make a valid training config: {e}") from None
        for key in (*self.spec.all_scale_keys, self.spec.lr_key):
            if key not in self.spec.axes:
                raise SweepError(f"{key!r} is not an axis; set scale_key/lr_key to one of {list(self.spec.axes)}")

    def config_dict(self, cell: Mapping) -> dict:
        data = json.loads(json.dumps(self.base))
        selected = {k: dep.values[str(cell.get(dep.by))] for k, dep in self._dependent_overrides.items()
                    if str(cell.get(dep.by)) in dep.values}
        return apply_overrides(data, [f"{k}={json.dumps(v)}" for k, v in {**selected, **cell}.items()])

    def config(self, cell: Mapping):
        return build_config(self.config_dict(cell))

    def optims(self, *keys: str) -> list:
        """The optim configs of one cell per distinct value of the cells' ``keys`` (a config for every cell costs
        ~0.3 ms each: 0.4 s on quality's 1296-cell paper grid, at every resume)."""
        one_each: dict = {}
        for cell in self.cells:
            one_each.setdefault(tuple(cell.get(k) for k in keys), cell)
        return [self.config(cell).optim for cell in one_each.values()]

    def to_dict(self) -> dict:
        # with what MOGA's and Muon's defaults run today: a store compares them when it is extended (sweep.compat)
        return {"spec": self.spec.model_dump(mode="json"), "base": self.base, **stamps()}


def _is_dependent(v) -> bool:
    return isinstance(v, Mapping) and "by" in v


def _matches(cell: Mapping, exclude: Mapping) -> bool:
    return all(k in cell and cell[k] == v for k, v in exclude.items())


def arm_label(optim) -> str:
    """What an optim config runs, in words: "muon (published)", "muon (moga preset)", "moga (paper preset)"; an
    optimizer without presets by its name. Outcomes name which Muon (and which MOGA) they compared."""
    if optim.name == "muon":
        preset = optim.preset if optim.preset in MUON_PRESETS else MUON_DEFAULT
        return "muon (published)" if preset == "published" else f"muon ({preset} preset)"
    if optim.name == "moga":
        return f"moga ({optim.preset or 'default'} preset)"
    return optim.name


def optimizer_labels(sweep: Sweep) -> dict[str, str]:
    """{optim.name: :func:`arm_label`} from one cell of each optimizer (a sweep that runs one preset of each)."""
    return {optim.name: arm_label(optim) for optim in sweep.optims("optim.name")}
