"""Muon: the published recipe by default, moga's all-geometry Muon as a preset (docs/math.md §3.4-3.6)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from moga.geometry import Embedding, Spectral, Vector, parse_geometry, spec_fields
from moga.optim.base import GeometryOptimizer
from moga.optim.options import SharedOptions, shared
from moga.orthogonalize import DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS
from moga.roles import ADAM_PREFIX, VECTOR_UPDATES, role_geometries

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+; annotations are not evaluated at run time
    from typing_extensions import Unpack


@dataclass(frozen=True)
class MuonPreset:
    """A Muon recipe's defaults; every one can be given explicitly."""

    lr: float
    weight_decay: float
    scale: str  # the spectral factor (moga.geometry.SPECTRAL_SCALES)
    betas: tuple[float, float]  # the Adam parts'
    hidden_only: bool  # orthogonalize hidden and conv matrices only, AdamW elsewhere; else every matrix
    describe: str


# Keller Jordan's Muon, torch.optim.Muon's documented use and Moonlight (arXiv 2502.16982): the orthogonalized
# step on hidden matrices, AdamW on tables, head, input layer and vectors. torch.optim.Muon's lr, weight decay and
# momentum; Moonlight's update-RMS matching (0.2 sqrt(max(m, n)), torch's adjust_lr_fn="match_rms_adamw") so that
# one lr serves the AdamW parts too, with Moonlight's and Keller Jordan's Adam betas (0.9, 0.95).
PUBLISHED = MuonPreset(1e-3, 0.1, "match_rms_adamw", (0.9, 0.95), True,
                       "the published Muon: orthogonalized hidden matrices, AdamW on tables, head and vectors")
# moga's Muon before the published recipe became the default: spectral on every matrix (head and input layer
# too), MOGA's embedding geometry on tables, at one lr 0.02 with the geometry's sqrt(m/n), no weight decay.
MOGA_MUON = MuonPreset(0.02, 0.0, "mean", (0.9, 0.999), False,
                       "moga's all-geometry Muon: spectral on every matrix, MOGA's embedding geometry on tables")
MUON_PRESETS: dict[str, MuonPreset] = {"published": PUBLISHED, "moga": MOGA_MUON}
MUON_PRESET_NAMES = tuple(MUON_PRESETS)
MUON_DEFAULT = "published"  # a sweep store records it: stores without the record ran "moga"
ADAMW = ADAM_PREFIX + str(Vector())  # Adam's direction in l_inf with no factor, decoupled decay: AdamW


def muon_preset(preset: str) -> MuonPreset:
    """Muon's preset ``preset``, or a clear error naming them."""
    if not isinstance(preset, str) or preset not in MUON_PRESETS:
        raise ValueError(f"Muon's preset must be one of {', '.join(map(repr, MUON_PRESET_NAMES))} (\"published\": "
                         f"{PUBLISHED.describe}; \"moga\": {MOGA_MUON.describe}), got {preset!r}")
    return MUON_PRESETS[preset]


def published_geometries(spectral: Spectral, vectors: str) -> dict[str, str]:
    """The published recipe's roles: spectral on hidden and conv matrices, AdamW on the rest."""
    if vectors not in VECTOR_UPDATES:
        raise ValueError(f"vectors must be one of {sorted(VECTOR_UPDATES)}, got {vectors!r}")
    return {"embedding": ADAMW, "input": ADAMW, "hidden": str(spectral), "readout": ADAMW, "tied": ADAMW,
            "conv": str(spectral), "vector": VECTOR_UPDATES[vectors]}


class Muon(GeometryOptimizer):
    """Muon: ``-s(m,n) U V^T`` of the Nesterov momentum, from a Newton-Schulz iteration, on hidden matrices.

    ``preset="published"`` (the default) is the Muon of Keller Jordan, torch.optim.Muon's documentation and
    Moonlight: hidden and conv matrices take the orthogonalized step; embedding tables, the head (readout or
    tied), a dense input layer and every vector take AdamW (betas (0.9, 0.95)), all at one ``lr`` (default
    1e-3) with decoupled weight decay 0.1 (vectors undecayed). One lr serves both because the spectral factor is
    Moonlight's ``scale="match_rms_adamw"``, ``0.2 sqrt(max(m, n))``, which gives the orthogonalized step the
    update RMS of AdamW's. ``preset="moga"`` is moga's all-geometry Muon (this class's behaviour before the
    published recipe): spectral on every matrix, head included, MOGA's ``embedding(q)`` geometry on tables,
    ``lr`` 0.02, ``scale="mean"`` (the geometry's ``sqrt(m/n)``), no weight decay. Arguments left unset take
    the preset's value.

    ``scale="torch"`` is torch.optim.Muon's default factor ``sqrt(max(1, m/n))`` (``adjust_lr_fn="original"``);
    it orthogonalizes in bfloat16, as torch does, unless ``ns_dtype`` says otherwise, and each matrix on its
    own, so the hidden matrices step bit for bit as torch.optim.Muon's with the same lr and decay (and the
    AdamW parts as torch.optim.AdamW(fused=True)'s). ``ns_dtype="auto"`` (the default for the other scales) is
    bfloat16 where the hardware multiplies it fast (GPUs, CPUs with AMX or AVX512-BF16), else float32; with
    ``ns_dtype="bfloat16"``, ``scale="match_rms_adamw"`` is torch's ``adjust_lr_fn="match_rms_adamw"``. Otherwise
    same-shape matrices share one batched Newton-Schulz call. Torch-style params (no model) all take the
    orthogonalized step, as torch.optim.Muon's do.

    Sharded (FSDP2) matrices are split among the ranks of their shard group: each rank gathers and
    orthogonalizes its share and sends the slices back. Plain matrices are split the same way when
    ``distributed`` is on (``None``: when torch.distributed is initialized with world size > 1), and one
    all-gather shares the results: that assumes they are replicated, as under DDP. Pass
    ``distributed=False`` when ranks train different models.
    """

    def __init__(
        self,
        params,
        lr: float | None = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float | None = None,
        *,
        preset: str = MUON_DEFAULT,
        scale: str | None = None,
        ns_steps: int = DEFAULT_NS_STEPS,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        ns_dtype: str | None = None,
        method: str = "newton_schulz",
        embedding_q: float | None = None,
        vectors: str = "adamw",
        betas: tuple[float, float] | None = None,
        **options: Unpack[SharedOptions],
    ):
        """``options``: the keywords every geometry optimizer shares (:class:`~moga.optim.options.SharedOptions`)."""
        chosen = muon_preset(preset)  # a bad name fails before anything is built
        scale = chosen.scale if scale is None else scale
        if ns_dtype is None:  # torch's scale promises torch's numbers: its dtype too
            ns_dtype = "bfloat16" if scale == "torch" else "auto"
        spectral = Spectral(method=method, steps=ns_steps, coefficients=ns_coefficients, dtype=ns_dtype, scale=scale)
        if chosen.hidden_only:
            if embedding_q is not None:
                raise ValueError("embedding_q sets the embedding geometry of preset='moga'; the published Muon runs "
                                 "AdamW on embedding tables")
            self.role_geometries = published_geometries(spectral, vectors)
        else:
            self.role_geometries = role_geometries(spectral, Embedding(2.0 if embedding_q is None else embedding_q),
                                                   vectors)
        _warn_unset_spectral(spectral, options.get("geometries"))
        self.preset = preset
        super().__init__(params, chosen.lr if lr is None else lr, momentum=momentum, nesterov=nesterov,
                         weight_decay=chosen.weight_decay if weight_decay is None else weight_decay,
                         betas=chosen.betas if betas is None else betas, geometry=spectral,
                         **shared(type(self), options))


def _warn_unset_spectral(spectral: Spectral, geometries) -> None:
    """A user's plain ``"spectral"`` for a role takes the geometry's defaults (scale ``"mean"``, sqrt(m/n)), not
    this Muon's: with the published preset that drops Moonlight's 0.2 sqrt(max(m, n)), which silently changes
    the recipe (a 4.5x smaller step on a 512 x 512 matrix). Say which settings it drops and how to keep them."""
    for role, spec in (geometries or {}).items():
        mine = parse_geometry(spec)
        if type(mine) is not Spectral:
            continue
        named = spec_fields(spec)
        dropped = [f"{f.name}={getattr(spectral, f.name)}" for f in fields(Spectral)
                   if f.name not in named and getattr(mine, f.name) != getattr(spectral, f.name)]
        if dropped:
            warnings.warn(f"Muon: geometries={{{role!r}: {str(spec)!r}}} steps {role} with the spectral geometry's "
                          f"defaults, not this Muon's {', '.join(dropped)}; name them in the spec to keep them "
                          f"(e.g. {str(spectral)!r})", UserWarning, stacklevel=3)
