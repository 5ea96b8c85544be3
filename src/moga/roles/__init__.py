"""Which parameter plays which role in an unmodified ``nn.Module``, and so which geometry it gets.

``build_plan(model)`` looks at the modules that own each parameter (no model surgery, nothing stored on
tensors) and returns a :class:`RolePlan`: an inspectable, printable table of parameter, role, layout and
geometry, with param groups for the optimizers. Roles:

- ``embedding``: ``nn.Embedding`` tables (one-hot inputs), layout ``io``;
- ``input``: the first dense matrix layer (outside repeated blocks) when it reads the model input;
- ``hidden``: every other matrix layer, including those in repeated blocks;
- ``readout``: the last dense matrix layer outside repeated blocks (the head);
- ``conv``: convolution kernels, as out x (in*kernel);
- ``tied``: one tensor used as both an embedding table and a dense layer (GPT-2's, LLaMA's or T5's
  ``lm_head``, BERT's MLM decoder). It is updated in the head's orientation (vocab x d) with the tied
  role's geometry, and the plan prints that choice and why on one line; an override still wins;
- ``vector``: biases, norm gains, any 0-D/1-D parameter, and tensors with at most one axis longer
  than 1 (ViT's ``cls_token`` of shape (1, 1, d)).

Mixtures of experts and other odd parameters are placed by what their module says about them, and the
plan prints each such choice with its reason (one ``note:`` line per kind):

- a router (Hugging Face's ``*TopKRouter``: a ``weight`` of shape (num_experts, hidden_dim) read as
  ``F.linear(x, weight)``) is a hidden matrix, layout ``oi``;
- a fused expert stack (transformers 5's ``experts.gate_up_proj`` / ``experts.down_proj``, on a module
  that says ``is_transposed``) is a hidden matrix per expert: layout ``boi`` (``bio`` when transposed), the
  expert axis a batch axis; per-expert biases (num_experts, d) are vectors. transformers 4.x's
  ``ModuleList`` of ``nn.Linear`` experts needs nothing special;
- a state-space model's ``A_log`` (Mamba: ``A = -exp(A_log)``, used elementwise) is a vector;
- a scalar such as CLIP's ``logit_scale`` is a vector (Adam's step on one number).

A contrastive model (a scalar temperature ``logit_scale`` at its root: CLIP, SigLIP, CLAP) also gets the
plan's ``lr_multipliers``: its vectors and tables step at 1/8 of the lr (see :func:`_contrastive_multipliers`).

Anything else the rules cannot place (a 2-D or 3-D tensor on an unknown module) is an error that lists
every such tensor at once, with one override glob per group, never a silent guess: the suggested role and
layout are how the forward uses the tensor, seen by running it once on ``example_inputs`` (or a Hugging Face
model's ``dummy_inputs``; :mod:`moga.forward_use`), and a group whose use moga cannot tell is a commented line
that says why. Override
patterns match a parameter's name or the name of the module that owns it (``"*.experts"``). First and last are taken in registration order,
or in call order when ``example_inputs`` are given; a tied tensor counts at its first and at its last use.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

from torch import nn

from moga.forward_use import VECTOR, agreed_use, observe_uses
from moga.geometry import Geometry, parse_geometry
from moga.layout import as_layout
from moga.roles.plan import PlanEntry, RolePlan, block_glob
from moga.roles.usage import (
    ODD_KINDS, OwnedParam, call_order, in_repeated_block, owned_params, param_usage, param_usages
)

ROLES = ("embedding", "input", "hidden", "readout", "tied", "conv", "vector")
ADAM_PREFIX = "adam:"

# MOGA's defaults: row(p=2) for matrices, the embedding geometry for tables, Adam for vectors.
MOGA_GEOMETRIES: dict[str, str] = {
    "embedding": "embedding(q=2)",
    "input": "row(p=2)",
    "hidden": "row(p=2)",
    "readout": "row(p=2)",
    # The head's row(2) norm and the table's embedding(2) norm both normalize each token's d-vector; the
    # head's is the larger, so its unit ball is the intersection of both balls.
    "tied": "row(p=2)",
    "conv": "row(p=2)",
    "vector": "adam:vector",
}
MATRIX_ROLES = ("input", "hidden", "readout", "tied", "conv")
VECTOR_UPDATES = {"adamw": "adam:vector", "sign": "vector"}


def role_geometries(matrix: Geometry | str, embedding: Geometry | str, vectors: str, update: str = "lmo") -> dict[str, str]:
    """The policy behind every preset optimizer: one geometry for all matrices, one for embedding tables,
    and Adam (``vectors="adamw"``) or the l_inf sign step (``"sign"``) for vectors. ``update="adam"`` gives
    the matrices and tables Adam's direction in place of their sign geometry's ``sign(G)``. The plan keeps
    spec strings (``str(geometry)``), which survive ``state_dict``."""
    if vectors not in VECTOR_UPDATES:
        raise ValueError(f"vectors must be one of {sorted(VECTOR_UPDATES)}, got {vectors!r}")
    if update not in ("lmo", "adam"):
        raise ValueError(f"update must be 'lmo' or 'adam', got {update!r}")
    prefix = ADAM_PREFIX if update == "adam" else ""
    # parse_geometry fails on p < 1 and the like before any model is looked at
    matrix_spec, embedding_spec = (prefix + str(parse_geometry(g)) for g in (matrix, embedding))
    return {
        **{role: matrix_spec for role in MATRIX_ROLES},
        "embedding": embedding_spec,
        "vector": VECTOR_UPDATES[vectors],
    }


class PlanError(ValueError):
    """A parameter the role rules cannot place; the message says which override to give."""


# --- building the plan ---------------------------------------------------------------------------------


def build_plan(
    model: nn.Module,
    geometries: Mapping[str, str] | None = None,
    overrides: Mapping[str, str | Mapping] | None = None,
    example_inputs=None,
) -> RolePlan:
    """The role plan of ``model``.

    ``geometries`` maps role -> geometry spec (``MOGA_GEOMETRIES`` by default; a spec prefixed ``adam:``
    uses Adam's direction in place of that sign geometry's ``sign(G)``). ``overrides`` maps parameter-name
    glob patterns to a role (``"hidden"``), a role and layout (``"hidden:boi"``), or a dict with any of
    ``role``, ``layout``, ``geometry``.
    """
    geoms = {**MOGA_GEOMETRIES, **(geometries or {})}
    unknown = set(geoms) - set(ROLES)
    if unknown:
        raise PlanError(f"unknown role(s) {sorted(unknown)} in geometries; roles are {', '.join(ROLES)}")
    for spec in geoms.values():  # a bad spec fails before any parameter is looked at
        parse_geometry(spec.removeprefix(ADAM_PREFIX))
    rules = _parse_overrides(overrides or {})
    used_rules: set[str] = set()
    params = owned_params(model)
    order = call_order(model, example_inputs) if example_inputs is not None else None

    kinds: dict[int, tuple[str, str | None]] = {}
    matched: dict[int, dict] = {}
    pending: list[PlanError] = []
    unplaced: list[OwnedParam] = []
    for item in params:
        usages = param_usages(item)
        owners = [mname for mname, _, _ in item.owners if mname]
        override = matched[id(item.param)] = _match(rules, [*item.names, *owners], used_rules) or {}
        if override.get("role"):
            continue  # decided below, whatever the modules say
        if len(usages) == 1:
            kinds[id(item.param)] = next(iter(usages))
        elif _is_tie(usages):
            kinds[id(item.param)] = ("tied", dict(usages)["linear"])  # the head's orientation
        elif not usages:
            unplaced.append(item)
        else:
            kinds_seen = sorted(k for k, _ in usages)
            where = ", ".join(f"{n} ({type(m).__name__})" for n, m, _ in item.owners)
            pending.append(PlanError(
                f"parameter {item.names[0]!r} is shared as {' and '.join(kinds_seen)} by {where}. Say how to "
                f"update it: overrides={{{item.names[0]!r}: 'tied'}} (the head's row geometry: the intersection "
                "of both unit balls), or 'embedding' / 'readout'"))
    if unplaced:
        raise _unplaced_error(unplaced, model, example_inputs)
    if pending:
        raise pending[0]

    # First and last dense layers outside repeated blocks are the input and the readout. A tied tensor is
    # both: it is first by its table and last by its head, and then neither role goes to another layer.
    if order is None:
        order = {id(m): k for k, m in enumerate(model.modules())}

    def positions(item: OwnedParam) -> list[int]:
        return [order.get(id(m), 10**9) for _, m, _ in item.owners] or [10**9]

    matrices = [it for it in params if kinds.get(id(it.param), ("vector", None))[1] is not None]
    edge: dict[int, str] = {}
    if matrices:
        first = min(matrices, key=lambda it: min(positions(it)))
        last = max(matrices, key=lambda it: max(positions(it)))
        outside = lambda it: not any(in_repeated_block(model, n) for n, _, _ in it.owners)  # noqa: E731
        if kinds[id(last.param)][0] == "linear" and outside(last):
            edge[id(last.param)] = "readout"
        if kinds[id(first.param)][0] == "linear" and outside(first) and first is not last:
            edge[id(first.param)] = "input"

    entries = []
    for item in params:
        override = matched[id(item.param)]
        kind, layout = kinds.get(id(item.param), (None, None))
        role = override.get("role") or {
            "vector": "vector", "embedding": "embedding", "conv": "conv", "tied": "tied",
            **{k: r for k, (r, _) in ODD_KINDS.items()},
        }.get(kind) or edge.get(id(item.param), "hidden")
        layout = override.get("layout", layout)
        if override.get("role"):
            layout = override.get("layout") or _layout_for_role(item, role)
        spec = override.get("geometry") or geoms[role]
        entry = _entry(item, role, layout, spec)
        if kind == "tied" and not override.get("role"):
            entry.reason = _tie_reason(item, entry, override)
        elif kind in ODD_KINDS and not override:
            entry.reason = ODD_KINDS[kind][1]
        entries.append(entry)
    missing = set(rules) - used_rules
    if missing:
        names = [n for it in params for n in it.names][:8]
        raise PlanError(f"override pattern(s) {sorted(missing)} match no parameter; names look like {names}")
    return RolePlan(entries, *_contrastive_multipliers(model, entries))


# A contrastive model's tensors that every sample shares, and the tables, step at this fraction of the lr.
CONTRASTIVE_LR = 0.125
TEMPERATURES = ("logit_scale", "logit_scale_a", "logit_scale_t", "temperature")


def _contrastive_multipliers(model: nn.Module, entries: list[PlanEntry]) -> tuple[dict[str, float], str]:
    """A model that declares a scalar temperature at its root (CLIP, SigLIP, CLAP, ALIGN...) is trained by
    a contrastive loss over the directions of normalized embeddings. A step that moves every sample the
    same way (a bias, a norm gain, a position or class table) moves every embedding the same way, and at
    the full lr it collapses them onto one direction: all logits equal, the loss stuck at log(batch).
    Measured on a tiny CLIPModel (4 pairs, 8 seeds x 2 batches, 10 default MOGA steps): mean loss 1.23 (chance
    is 1.39) and 1.20 with logit_scale frozen; the mean cosine between different texts 0.94; with vectors and
    tables frozen (6 runs) 0.019 and 0.24; at 1/8 of the lr 0.18 (worst 0.54), the matrices still at the full lr."""
    temperature = next((n for n, p in model.named_parameters(recurse=False) if n in TEMPERATURES and p.ndim == 0),
                       None)
    roles = {e.role for e in entries} & {"vector", "embedding"}
    if temperature is None or not roles:
        return {}, ""
    reason = (f"a contrastive model (the scalar temperature {temperature!r}): full-lr steps on the vectors "
              "and tables every sample shares pull all embeddings onto one direction (the loss sticks at "
              "log(batch)); they step at 1/8 of the lr (override: lr_multipliers={'vector': 1, 'embedding': 1})")
    return {role: CONTRASTIVE_LR for role in sorted(roles)}, reason


def _is_tie(usages: set[tuple[str, str | None]]) -> bool:
    """One tensor read as a table by embeddings and as a matrix by dense layers, all in one orientation."""
    kinds = [k for k, _ in usages]
    return sorted(set(kinds)) == ["embedding", "linear"] and kinds.count("linear") == 1


def _tie_reason(item: OwnedParam, entry: PlanEntry, override: dict) -> str:
    def uses(kind):
        return ", ".join(f"{n} ({type(m).__name__})" for n, m, p in item.owners
                         if (param_usage(m, p, item.param) or ("",))[0] == kind)

    m, n = entry.matrix_shape
    source = "the override's" if override.get("geometry") else "the 'tied' role's"
    return (f"{entry.name}: shared by the table {uses('embedding')} and the head {uses('linear')}, so one update "
            f"serves both: role 'tied', {source} geometry {entry.geometry} in the head's orientation ({m}x{n}), "
            f"where it bounds the change of the logits; override with {{{entry.name!r}: 'embedding'}} or 'readout'")


def _layout_for_role(item: OwnedParam, role: str) -> str | None:
    """The layout an overridden role implies, from how the tensor's owners use it."""
    if role == "vector":
        return None
    usages = param_usages(item)
    by_kind = dict(usages)
    if role == "embedding" and "embedding" in by_kind:
        return by_kind["embedding"]
    if role in ("tied", "readout", "hidden", "input") and "linear" in by_kind:
        return by_kind["linear"]
    if "conv" in by_kind:
        return by_kind["conv"]
    if len(usages) == 1 and next(iter(usages))[1] is not None:
        return next(iter(usages))[1]
    raise PlanError(
        f"parameter {item.names[0]!r} of shape {tuple(item.param.shape)} needs a layout for role {role!r}: "
        f"write overrides={{{item.names[0]!r}: '{role}:<layout>'}}, one letter per axis: 'o' the axis of the "
        f"module's outputs, 'i' of its inputs, 'b' a batch of independent matrices (leave the role out to see "
        f"how the forward uses it)")


def _entry(item: OwnedParam, role: str, layout: str | None, spec: str) -> PlanEntry:
    update = "lmo"
    if spec.startswith(ADAM_PREFIX):
        update, spec = "adam", spec[len(ADAM_PREFIX):]
    geometry = parse_geometry(spec)
    name = item.names[0]
    if geometry.matrix:
        if layout is None:
            raise PlanError(f"{name!r} ({role}, shape {tuple(item.param.shape)}) has no fan_out/fan_in layout for the "
                            f"matrix geometry {geometry}; give it one, overrides={{{name!r}: {{'layout': ...}}}} with "
                            "one letter per axis ('o' the axis of the module's outputs, 'i' of its inputs, 'b' a "
                            "batch), or a vector geometry")
        try:
            as_layout(layout).check(item.param.shape)
        except ValueError as e:
            known = sorted({lay for _, lay in param_usages(item) if lay})
            hint = f", e.g. '{known[0]}' (how its module reads it)" if len(known) == 1 else f" ({item.param.ndim} here)"
            raise PlanError(f"parameter {name!r} ({role}, on {_owner_names(item)}): {e}; a layout has one letter "
                            f"per axis{hint}") from None
    if update == "adam" and geometry.sign_scale(item.param.shape, layout) is None:
        raise PlanError(f"'adam:' needs a sign geometry (sign, row(p=1), col(q=inf), embedding(q=inf), vector), "
                        f"not {geometry} (for {name!r})")
    owner = "/".join(sorted({type(m).__name__ for _, m, _ in item.owners}))
    return PlanEntry(name, item.param, role, layout, str(geometry), update, owner, tuple(item.names[1:]))


def _owner_names(item: OwnedParam) -> str:
    return "/".join(sorted({type(m).__name__ for _, m, _ in item.owners}))


def _unplaced_error(items: list[OwnedParam], model: nn.Module, example_inputs) -> PlanError:
    """One error for every tensor the rules cannot place, grouped by the override that would place them. Each
    suggestion is how the forward uses the tensor (:mod:`moga.forward_use`), run on ``example_inputs`` or a
    Hugging Face model's own ``dummy_inputs``; where moga cannot tell, the line says so and suggests nothing."""
    groups: dict[str, list[OwnedParam]] = {}
    for item in items:
        groups.setdefault(block_glob(item.names[0]), []).append(item)
    inputs, source = example_inputs, "the example inputs"
    if inputs is None:
        inputs, source = _dummy_inputs(model), "the model's dummy_inputs"
    seen = (observe_uses(model, [it.param for it in items], inputs) if inputs is not None
            else "no example inputs to run the forward on")
    rows = []
    for pattern, members in groups.items():
        first = members[0]
        shapes = sorted({tuple(m.param.shape) for m in members})
        count = f"{len(members)} tensors" if len(members) > 1 else "1 tensor"
        where = f"{count}, {' '.join(map(str, shapes))}, on {_owner_names(first)}"
        uses = set().union(*(seen.get(id(m.param), set()) for m in members)) if not isinstance(seen, str) else set()
        use = agreed_use(uses)
        if use == VECTOR:
            rows.append((f"{pattern!r}: 'vector',", f"{where}: used elementwise"))
        elif use is not None:
            rows.append((f"{pattern!r}: 'hidden:{use}',", f"{where}: a matrix product reads it as {use}"))
        else:
            why = seen if isinstance(seen, str) else (
                "the forward did not use it" if not uses else f"the forward uses it as {' and '.join(sorted(uses))}")
            rows.append((f"# {pattern!r}: ?,", f"{where}: cannot tell ({why})"))
    width = max(len(code) for code, _ in rows)
    lines = [f"    {code.ljust(width)}  # {why}" for code, why in rows]
    checked = (f"each suggestion is how the forward uses the tensor, run once on {source}"
               if not isinstance(seen, str) else "moga could not check any use: " + seen
               + " (moga.build_plan(model, example_inputs=...) runs it once to find each tensor's use)")
    return PlanError(
        f"cannot place {len(items)} parameter(s): no torch layer owns them and their modules declare nothing "
        f"moga reads. Name a role and layout for each group ('o' is the axis of the module's outputs, 'i' of "
        f"its inputs, 'b' a batch of independent matrices; a parameter used elementwise is 'vector'); "
        f"{checked}:\n  overrides={{\n" + "\n".join(lines) + "\n  }")


def _dummy_inputs(model: nn.Module):
    """A Hugging Face model's own example batch (``PreTrainedModel.dummy_inputs``), when it has one."""
    try:
        inputs = getattr(model, "dummy_inputs", None)
    except Exception:  # noqa: BLE001 - a property of someone else's model; no inputs then
        return None
    return inputs if isinstance(inputs, dict) else None


def _parse_overrides(overrides: Mapping[str, str | Mapping]) -> dict[str, dict]:
    rules = {}
    for pattern, value in overrides.items():
        if isinstance(value, str):
            role, _, layout = value.partition(":")
            rule = {"role": role, **({"layout": layout} if layout else {})}
        elif isinstance(value, Mapping):
            rule = dict(value)
            bad = set(rule) - {"role", "layout", "geometry"}
            if bad:
                raise PlanError(f"override {pattern!r}: unknown key(s) {sorted(bad)}; use role, layout, geometry")
        else:
            raise PlanError(f"override {pattern!r} must be a role string or a dict, got {type(value).__name__}")
        if "role" in rule and rule["role"] not in ROLES:
            raise PlanError(f"override {pattern!r}: unknown role {rule['role']!r}; roles are {', '.join(ROLES)}")
        if rule.get("layout"):
            as_layout(rule["layout"])
        rules[pattern] = rule
    return rules


def _match(rules: dict[str, dict], names: Iterable[str], used: set[str]) -> dict | None:
    found = None
    for pattern, rule in rules.items():
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            used.add(pattern)
            found = rule if found is None else {**found, **rule}
    return found
