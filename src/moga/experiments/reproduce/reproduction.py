"""A reproduction as data: one YAML file per claim (``configs/``), read into :class:`Reproduction` by
:mod:`.catalog`.

A file names the paper, figure and claim, the kind of analysis (:mod:`.kinds`: ``transfer``, an lr sweep and its
transfer verdicts; ``joint``, the same over two scale axes; ``race``, tokens and time to a loss; ``convergence``,
the convergence paper's experiment; ``quality``, ``gap``, ``tune``), what the paper expects of each panel, and a
``sweep`` shared by every scale. ``scales.quick`` / ``cpu`` / ``paper`` each deep-merge their own ``sweep`` into it
(an axis or an exclusion list given there replaces the shared one whole), name their default data set, and for the
paper scale say where the setup comes from (``source``) and what the paper's text leaves open (``silent``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from moga.sweep.spec import Sweep

CONFIGS = Path(__file__).parent / "configs"
SCALES = ("quick", "cpu", "paper")


class ReproduceError(ValueError):
    """A reproduction that does not exist or cannot be set up as asked."""


@dataclass
class Reproduction:
    name: str
    paper: str
    figure: str
    claim: str
    kind: str
    raw: dict = field(repr=False)

    @property
    def expect(self) -> list[dict]:
        return list(self.raw.get("expect", []))

    @property
    def group_keys(self) -> list[str]:
        return list(self.raw.get("group_keys", ["optimizer", "scaling"]))

    def scale(self, scale: str) -> dict:
        if scale not in SCALES:
            raise ReproduceError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
        return dict(self.raw.get("scales", {}).get(scale) or {})

    def sweep_dict(self, scale: str = "cpu", data: str | None = None) -> dict:
        """The sweep config of one scale; ``data`` replaces the data set (a name, or for text a file or
        a prepared directory)."""
        if "sweep" not in self.raw:  # convergence and tune run their own experiments
            raise ReproduceError(f"{self.name} is not a sweep")
        s = self.scale(scale)
        spec = merge(copy.deepcopy(self.raw["sweep"]), s.get("sweep", {}))
        spec["name"] = f"{self.name}-{scale}"
        spec.setdefault("base", {}).setdefault("data", {})
        chosen = data or s.get("data")
        if chosen is not None:
            apply_data(spec["base"]["data"], chosen)
        return spec

    def sweep(self, scale: str = "cpu", data: str | None = None):
        return Sweep.from_dict(self.sweep_dict(scale, data))

    def settings(self, scale: str = "cpu", data: str | None = None) -> dict:
        """Settings of the convergence experiment (moga.experiments.smoothness.convergence)."""
        s = dict(self.scale(scale).get("settings", {}))
        if data:
            s["data"] = [d.strip() for d in data.split(",")]
        return s


def merge(base: dict, over: dict) -> dict:
    """Deep merge; under ``axes`` each axis is replaced whole, and lists are replaced."""
    for key, value in over.items():
        if key == "axes" and isinstance(value, dict):
            base.setdefault("axes", {}).update(copy.deepcopy(value))
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def apply_data(section: dict, data: str) -> None:
    if section.get("name") == "text":
        path = Path(data).expanduser()
        if path.is_dir():
            section["data_dir"] = str(path)
        elif path.suffix or path.exists():
            section["text_path"] = str(path)
        else:
            raise ReproduceError(f"--data for a text reproduction is a text file or a directory with "
                                 f"train.bin/val.bin, got {data!r}")
        return
    section["name"] = data


def tune_settings(rep: Reproduction, scale: str) -> dict:
    """A tune claim's settings (``tune:``) with its scale's own ``tune:`` merged in."""
    return merge(copy.deepcopy(rep.raw.get("tune", {})), rep.scale(scale).get("tune", {}))


def read_reproduction(path: Path) -> Reproduction:
    """One claim's YAML file (its kind is checked against the registered kinds by :mod:`.catalog`)."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    missing = {"name", "paper", "figure", "claim", "kind"} - set(raw)
    if missing:
        raise ReproduceError(f"{path.name}: missing {sorted(missing)}")
    return Reproduction(raw["name"], raw["paper"], str(raw["figure"]), raw["claim"], raw["kind"], raw)
