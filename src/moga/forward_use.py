"""How a model's forward uses a tensor no torch layer owns: as a matrix (and in which layout) or elementwise.

The role rules (:mod:`moga.roles`) read what a parameter's module declares; a parameter of a custom module
declares nothing, and a guessed override can be wrong in ways that train silently (a bias added
elementwise given a matrix geometry; a stack of (in, out) matrices given ``boi``). :func:`observe_uses`
runs the forward once on example inputs under a :class:`~torch.overrides.TorchFunctionMode` and follows
each such parameter through the views taken of it (indexing, ``unsqueeze``, transposes, dtype casts,
shape-keeping pointwise ops) to the operations that consume it:

- a matrix product (``F.linear``, ``matmul``/``@``, ``mm``, ``bmm``, the ``add*mm`` family, ``einsum``,
  ``F.conv*``) fixes each of its axes: contracted is fan_in ``i``, kept is fan_out ``o``, an axis paired
  with the other operand's (or picked by an integer index) is a batch ``b``;
- a pointwise op that broadcasts it against a larger tensor (a bias, a gate, Mamba's ``A``) is an
  elementwise use: a vector;
- anything else (a reshape, a reduction) is a use moga does not follow, and then it says it cannot tell.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

VECTOR = "vector"

# ops that return the same values in the same axes
_SAME_AXES = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "contiguous", "clone", "detach",
              "requires_grad_", "expand", "expand_as", "broadcast_to"}
_TRANSPOSES = {"t", "transpose", "swapaxes", "swapdims", "permute"}
_PROPERTIES = {"T", "mT", "H", "mH"}
# (operands that are multiplied as matrices, operand added elementwise) by position
_MATMULS = {"matmul": (0, 1, None), "__matmul__": (0, 1, None), "mm": (0, 1, None), "bmm": (0, 1, None),
            "__rmatmul__": (1, 0, None), "addmm": (1, 2, 0), "baddbmm": (1, 2, 0), "addbmm": (1, 2, 0)}
_ADDMM_KWARGS = {"input": 0, "mat1": 1, "mat2": 2, "batch1": 1, "batch2": 2}


@dataclass(frozen=True)
class _View:
    param: int  # id of the parameter it shows
    axes: tuple[int | None, ...]  # per axis of the view, the parameter's axis (None: a new one)
    picked: frozenset[int] = frozenset()  # parameter axes an integer index picked one slice of


def observe_uses(model: nn.Module, params: list[torch.Tensor], example_inputs) -> dict[int, set[str]] | str:
    """``{id(param): uses}`` for each of ``params`` over one forward of ``model`` on ``example_inputs`` (a
    tensor, a tuple of positional arguments, or a dict of keyword arguments); each use is a layout
    (``"boi"``), ``"vector"`` or ``"unknown: <op>"``. A string saying why, when the forward did not run."""
    mode = _Follow({id(p): _View(id(p), tuple(range(p.ndim))) for p in params})
    training = {m: m.training for m in model.modules()}
    model.eval()  # no running statistics move
    try:
        with torch.no_grad(), mode:
            if isinstance(example_inputs, dict):
                model(**example_inputs)
            else:
                model(*(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)))
    except Exception as e:  # noqa: BLE001 - any failure of a user's forward means: not checked
        return f"the forward on the example inputs failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    finally:
        for m, flag in training.items():
            m.train(flag)
    return {id(p): mode.uses.get(id(p), set()) for p in params}


def agreed_use(uses: set[str]) -> str | None:
    """The one use every observed use agrees on (a layout or ``"vector"``), or None."""
    return next(iter(uses)) if len(uses) == 1 and not next(iter(uses)).startswith("unknown") else None


class _Follow(TorchFunctionMode):
    def __init__(self, views: dict[int, _View]):
        super().__init__()
        self.views = views
        self.keep: list[torch.Tensor] = []  # the followed views stay alive, so that their ids stay theirs
        self.uses: dict[int, set[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tracked = [(k, a) for k, a in enumerate(args) if isinstance(a, torch.Tensor) and id(a) in self.views]
        tracked += [(name, a) for name, a in kwargs.items() if isinstance(a, torch.Tensor) and id(a) in self.views]
        for i, seq in enumerate(args):  # einsum(eq, [a, b]): a list counts as its items in place
            if isinstance(seq, (list, tuple)):
                tracked += [(k, a) for k, a in enumerate(seq, i) if isinstance(a, torch.Tensor) and id(a) in self.views]
        if not tracked:
            return out
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        for where, tensor in tracked:
            view = self.views[id(tensor)]
            result = self._derive(name, view, tensor, where, args, kwargs, out)
            if isinstance(result, _View) and isinstance(out, torch.Tensor):
                self.views[id(out)] = result
                self.keep.append(out)
            elif isinstance(result, str):
                self.uses.setdefault(view.param, set()).add(result)
        return out

    def _derive(self, name, view, tensor, where, args, kwargs, out) -> _View | str | None:
        """The view ``out`` is of the parameter, or the use it makes of it (a layout, vector, unknown)."""
        if name in ("shape", "dtype", "device", "size", "dim", "numel", "requires_grad", "is_leaf", "ndim",
                    "grad", "__len__", "is_floating_point", "is_complex", "element_size", "stride", "__hash__"):
            return None  # reading metadata is no use
        if name in _SAME_AXES or name == "data":
            return _View(view.param, (None,) * (out.ndim - len(view.axes)) + view.axes, view.picked)
        if name in _TRANSPOSES or name in _PROPERTIES:
            return _transposed(name, view, args, kwargs)
        if name == "unsqueeze":
            axes = list(view.axes)
            d = args[1] if len(args) > 1 else kwargs["dim"]
            axes.insert(d % (len(axes) + 1), None)
            return _View(view.param, tuple(axes), view.picked)
        if name == "__getitem__":
            return _indexed(view, args[1], out)
        if name == "linear":
            return _letters_of(view, {"o": [0], "i": [1]}) if where in (1, "weight") else VECTOR
        if name in _MATMULS:
            left, right, added = _MATMULS[name]
            where = _ADDMM_KWARGS.get(where, where)
            if where == added:
                return VECTOR
            ndim = len(view.axes)
            if ndim < 2:
                return f"unknown: {name}"
            rest = list(range(ndim - 2))
            return _letters_of(view, {"b": rest, "i": [ndim - 1], "o": [ndim - 2]} if where == left
                           else {"b": rest, "i": [ndim - 2], "o": [ndim - 1]})
        if name == "einsum":
            return _einsum(view, where, args)
        if name in ("conv1d", "conv2d", "conv3d") and where in (1, "weight"):
            return _letters_of(view, {"o": [0], "i": list(range(1, len(view.axes)))})
        if _pointwise(name) and isinstance(out, torch.Tensor):
            if tuple(out.shape) == tuple(tensor.shape):
                return _View(view.param, view.axes, view.picked)  # a cast or a scale: still the tensor itself
            return VECTOR  # broadcast against a larger tensor: used elementwise
        return f"unknown: {name}"


def _transposed(name, view, args, kwargs) -> _View:
    axes = list(view.axes)
    if name in ("T", "H"):
        axes.reverse()
    elif name in ("t", "mT", "mH"):
        axes[-2:] = axes[-2:][::-1]
    elif name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        axes = [view.axes[d] for d in dims]
    else:
        a, b = (args[1], args[2]) if len(args) > 2 else (kwargs.get("dim0"), kwargs.get("dim1"))
        axes[a], axes[b] = axes[b], axes[a]
    return _View(view.param, tuple(axes), view.picked)


def _indexed(view: _View, index, out) -> _View | str:
    """A view by slices, ``None`` and integers: an integer picks one slice of that axis (a batch axis)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        k = index.index(Ellipsis)
        fill = len(view.axes) - sum(i is not None for i in index if i is not Ellipsis)
        index = index[:k] + (slice(None),) * fill + index[k + 1:]
    axes, picked, source = [], set(view.picked), 0
    for i in index:
        if i is None:
            axes.append(None)
        elif isinstance(i, slice):
            axes.append(view.axes[source])
            source += 1
        elif isinstance(i, int) or (isinstance(i, torch.Tensor) and i.ndim == 0 and not i.is_floating_point()):
            picked.add(view.axes[source])
            source += 1
        else:
            return "unknown: __getitem__"  # a tensor index gathers slices; where they go is not followed
    axes += view.axes[source:]
    if len(axes) != out.ndim:
        return "unknown: __getitem__"
    return _View(view.param, tuple(axes), frozenset(picked - {None}))


def _letters_of(view: _View, letters: dict[str, list[int]]) -> str:
    """The parameter's layout, from the role each axis of its view plays in a matrix product."""
    layout: dict[int, str] = {a: "b" for a in view.picked}
    for letter, dims in letters.items():
        for d in dims:
            if view.axes[d] is not None:
                layout[view.axes[d]] = letter
    ndim = max(layout, default=-1) + 1
    spec = "".join(layout.get(a, "?") for a in range(ndim))
    if "?" in spec or "o" not in spec or "i" not in spec:
        return "unknown: a product over part of its axes"
    return spec


def _einsum(view: _View, where, args) -> str:
    equation = args[0].replace(" ", "")
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    if "." in equation:
        return "unknown: einsum with '...'"
    inputs, _, output = equation.partition("->")
    subscripts = inputs.split(",")
    position = where - 1 if isinstance(where, int) else None
    if position is None or position >= len(subscripts) or len(operands) < 2:
        return "unknown: einsum"
    mine, others = subscripts[position], "".join(s for k, s in enumerate(subscripts) if k != position)
    if not output and "->" not in equation:
        output = "".join(sorted(c for c in inputs if inputs.count(c) == 1))
    letters = {"b": [], "o": [], "i": []}
    for d, c in enumerate(mine):
        kind = ("b" if c in others else "o") if c in output else ("i" if c in others else None)
        if kind is None:
            return "unknown: einsum summing an axis of its own"
        letters[kind].append(d)
    return _letters_of(view, letters)


def _pointwise(name: str) -> bool:
    """True for an op the ATen library tags pointwise (``add``, ``sigmoid``, ``where``, ...)."""
    base = name.strip("_")
    if name.startswith("__") and base[:1] in "ri" and base[1:] in ("add", "sub", "mul", "truediv", "pow", "div"):
        base = base[1:]  # __radd__, __imul__: the same op
    base = {"truediv": "div", "floordiv": "floor_divide"}.get(base, base)
    packet = getattr(torch.ops.aten, base, None)
    try:
        return packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
    except (AttributeError, RuntimeError):
        return False
