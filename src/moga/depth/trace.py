"""Finds residual branches from what a forward computes, not from class names.

One forward runs under a ``TorchFunctionMode`` that records every torch op as a node with its input
nodes, and forward hooks tag each node with the modules that returned it. For a block (a module that
is an element of a ``ModuleList``/``Sequential``) with stream input ``x`` and output ``y``:

- a node's *cost* is the fewest weight matrices (parameters with 2 or more dims) on a path from ``x``
  to it inside the block's forward; other inputs (masks, rotary tables, encoder states) do not count
  as paths. Norm gains, biases and layer scales are 1-D and cost nothing;
- the *spine* runs back from ``y`` to ``x`` along cheapest parents. An addition on it whose operands
  cost differently is a residual add: the cheaper operand is the stream (or a projection shortcut),
  the dearer one the branch;
- a branch is traced back through linear ops (dropout, casts, views, sums of branches, products with
  tensors that do not depend on ``x``) to the outermost module with parameters that returned it.

This is a concrete trace of the forward that runs, so data-dependent control flow, ``**kwargs`` and
in-place adds (``out += identity``) need no special case, unlike ``torch.fx`` symbolic tracing, which
stops at Hugging Face layers' control flow, or ``torch.export``, which takes seconds per block.
It covers pre-norm (LLaMA), post-norm (BERT: the add sits inside ``BertSelfOutput``), sandwich norms
(Gemma2: the branch ends at the post-norm), parallel attention and MLP (GPT-J, Falcon: one add of a
sum of two branches), residuals added inside a submodule (Bloom: ``self_attention.dense``), MoE blocks
and encoder-decoder stacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

INF = math.inf
# Ops whose values do not depend on their tensor inputs' values (only on shapes): no path runs through them.
CONSTANT = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full"}
ADDS = {"add", "__add__", "__radd__", "__iadd__", "add_"}
PRODUCTS = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_"}
# Ops through which a branch stays proportional to what its module returned.
LINEAR = {
    "dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "to", "type", "type_as", "float", "half",
    "bfloat16", "double", "contiguous", "clone", "view", "reshape", "view_as", "reshape_as", "flatten",
    "unflatten", "squeeze", "unsqueeze", "transpose", "permute", "__getitem__", "neg", "__neg__",
}


@dataclass(eq=False)
class Node:
    seq: int
    op: str
    parents: tuple
    weight: int  # 1 if the op reads a weight matrix of the model
    tensor: torch.Tensor = field(repr=False)  # held so that ids are not reused during the trace
    modules: list[str] = field(default_factory=list)  # modules that returned this tensor, inner first


@dataclass
class Call:
    """One call of a candidate block: where it starts and ends in the trace, and what it saw."""

    start: int
    source: Node
    args: tuple = field(repr=False)
    kwargs: dict = field(repr=False)
    end: int = -1
    output: Node | None = None
    passed: Node | None = None  # the stream the caller passed, where ``inputs`` replaced it


class Recorder(TorchFunctionMode):
    def __init__(self, weights: set[int]):
        super().__init__()
        self.weights = weights
        self.held: list[torch.Tensor] = []
        self.nodes: list[Node] = []
        self.current: dict[int, Node] = {}

    def node_of(self, tensor: torch.Tensor) -> Node:
        node = self.current.get(id(tensor))
        if node is None or node.tensor is not tensor:
            node = self._new(tensor, "input", (), 0)
        return node

    def _new(self, tensor, op, parents, weight) -> Node:
        node = Node(len(self.nodes), op, parents, weight, tensor)
        self.nodes.append(node)
        self.current[id(tensor)] = node
        return node

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs and out is not None:  # attribute reads (.shape, .dtype), sizes
            return out
        name = getattr(func, "__name__", "")
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        floats = [t for t in ins if t.is_floating_point()]
        weight = int(any(id(t) in self.weights for t in ins))
        if floats and all(id(t) in self.weights for t in floats):  # weight.T, weight.float(): still weights
            self.weights.update(id(t) for t in outs if t.dim() >= 2)
            self.held += outs  # their ids must stay theirs
            weight = 0
        # Values flow through floating tensors only: integer indices (MoE routing) and masks carry none.
        parents = () if name in CONSTANT else tuple(self.node_of(t) for t in floats)
        if out is None:
            if name == "__setitem__" and ins:  # x[i] = v writes into x
                self._new(ins[0], name, parents, weight)
            return out
        inplace = name.startswith("__i") or (name.endswith("_") and not name.endswith("__"))
        for t in outs:
            if not inplace and any(t is i for i in ins):
                continue  # the same tensor back (.to() to its own dtype, eval dropout): same node
            self._new(t, name, parents, weight)
        return out


def first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value:
        return first_tensor(value[0])
    if isinstance(value, dict):  # Hugging Face ModelOutput
        return next((first_tensor(v) for v in value.values() if first_tensor(v) is not None), None)
    return None


def stream_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The residual stream a block receives: its first tensor argument, or ``hidden_states``."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


class Costs:
    """Cheapest weight-matrix count from a block's stream input to each node of its call."""

    def __init__(self, recorder: Recorder, call: Call):
        self.call, self.cost = call, {id(call.source): 0}
        for node in recorder.nodes[call.start:call.end]:
            if id(node) not in self.cost:
                self.cost[id(node)] = min((self(p) for p in node.parents), default=INF) + node.weight

    def __call__(self, node: Node) -> float:
        return self.cost.get(id(node), INF)


@dataclass
class ResidualAdd:
    node: Node
    branch: Node  # the operand that is the branch


def spine(call: Call, costs: Costs):
    """The nodes from the block's output back to its input along cheapest parents, with the branch
    operand of each residual add on the way (None elsewhere)."""
    node, seen = call.output, set()
    while node is not None and node is not call.source and id(node) not in seen:
        seen.add(id(node))
        reachable = sorted((p for p in node.parents if costs(p) < INF), key=costs)
        if not reachable:
            return
        residual = node.op in ADDS and len(reachable) == 2 and costs(reachable[1]) > costs(reachable[0])
        yield node, (reachable[1] if residual else None)
        node = reachable[0]


def residual_adds(call: Call, costs: Costs) -> list[ResidualAdd]:
    """The residual adds on the block's spine, last first."""
    return [ResidualAdd(node, branch) for node, branch in spine(call, costs) if branch is not None]


def branch_sources(node: Node, costs: Costs, accept, seen=None, last=None) -> tuple[list[Node], Node | None]:
    """Nodes ``accept`` takes that ``node`` is a linear function of, through linear ops and sums of
    branches; and where that fails, the last module output passed (or the op) it cannot see through."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return [], None
    seen.add(id(node))
    if accept(node):
        return [node], None
    last = node if node.modules else last
    reachable = [p for p in node.parents if costs(p) < INF]
    if node.op in ADDS and len(reachable) == len(node.parents):
        follow = reachable
    elif node.op in PRODUCTS and len(reachable) == 1:
        follow = reachable  # times a tensor that does not depend on the stream (a gate, a layer scale)
    elif node.op in LINEAR and len(reachable) == 1:
        follow = reachable
    else:
        return [], last or node
    sources = []
    for parent in follow:
        more, stuck = branch_sources(parent, costs, accept, seen, last)
        if stuck is not None:
            return [], stuck
        sources += more
    return sources, None


def _relative(name: str, block: str) -> str:
    return name[len(block) + 1:] if block and name.startswith(block + ".") else name


class Trace:
    """One recorded forward: every op, and each candidate block's call. ``inputs`` (block -> (args,
    kwargs)) replaces what those blocks receive; ``record=False`` keeps only their outputs."""

    def __init__(self, model: nn.Module, candidates: set[str], inputs: dict | None = None, record: bool = True):
        self.model, self.candidates, self.inputs, self.record = model, candidates, inputs or {}, record
        weights = {id(p) for p in model.parameters() if p.dim() >= 2}
        self.recorder = Recorder(weights)
        self.calls: dict[str, list[Call]] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.param_modules = {n for n, m in model.named_modules() if any(True for _ in m.parameters())}

    def run(self, forward):
        handles = []
        for name, module in self.model.named_modules():
            if self.record:
                handles.append(module.register_forward_hook(self._tagger(name)))
            if name in self.candidates:
                handles.append(module.register_forward_pre_hook(self._opener(name), with_kwargs=True))
                handles.append(module.register_forward_hook(self._closer(name)))
        try:
            if not self.record:
                return forward()
            with self.recorder:
                return forward()
        finally:
            for h in handles:
                h.remove()

    def _tagger(self, name):
        def hook(module, args, output):
            t = first_tensor(output)
            if t is not None:
                self.recorder.node_of(t).modules.append(name)
        return hook

    def _opener(self, name):
        def hook(module, args, kwargs):
            passed = stream_input(args, kwargs)
            if name in self.inputs:
                args, kwargs = self.inputs[name]
            x = stream_input(args, kwargs)
            if x is not None and self.record:
                source = self.recorder.node_of(x)
                call = Call(len(self.recorder.nodes), source, args, kwargs)
                call.passed = self.recorder.node_of(passed) if passed is not None else None
                self.calls.setdefault(name, []).append(call)
            return args, kwargs
        return hook

    def _closer(self, name):
        def hook(module, args, output):
            t = first_tensor(output)
            if t is None:
                return
            calls = self.calls.get(name)
            if calls and calls[-1].end < 0:
                calls[-1].end = len(self.recorder.nodes)
                calls[-1].output = self.recorder.node_of(t)
            self.outputs.setdefault(name, t.detach().clone())  # later in-place ops cannot change it
        return hook

    def ran_once(self, name: str) -> bool:
        calls = self.calls.get(name, [])
        return len(calls) == 1 and calls[0].output is not None

    def costs(self, name: str) -> Costs | None:
        if not self.ran_once(name):
            return None  # a block runs once per forward
        return Costs(self.recorder, self.calls[name][0])

    def branches(self, block: str) -> tuple[list[str], list[str]]:
        """The modules whose outputs ``block``'s residual adds take as branches, and the problems met
        (a branch that is no submodule's output)."""
        costs = self.costs(block)
        if costs is None:
            return [], []
        found, problems = [], []

        def owned(node: Node) -> bool:
            return any(m.startswith(block + ".") and m in self.param_modules and not m.endswith(".residual_scale")
                       for m in node.modules)

        for add in residual_adds(costs.call, costs):
            sources, stuck = branch_sources(add.branch, costs, owned)
            if stuck is not None:
                problems.append(f"the branch added at {add.node.op!r} comes from {self.describe(stuck, block)}")
            for node in sources:
                name = [m for m in node.modules if m.startswith(block + ".") and m in self.param_modules][-1]
                if name not in found:
                    found.append(name)
        return found, problems

    def describe(self, node: Node, block: str) -> str:
        """A node for an error message: the module that returned it, or the op that made it."""
        named = [m for m in node.modules if m in self.param_modules] or [m for m in node.modules if m]
        if named:
            return f"the output of {_relative(named[-1], block)}"
        return f"the result of {node.op!r} in the forward of {block or 'the model'} (not a submodule's output)"

    def branch_hint(self, block: str) -> list[str]:
        """The modules whose outputs ``block``'s residual adds take, for an error message."""
        order = {name: i for i, (name, _) in enumerate(self.model.named_modules())}
        return sorted(self.branches(block)[0], key=order.__getitem__)


def outer_residual_add(recorder: Recorder, call: Call, accept=None) -> Node | None:
    """The add after ``call`` that takes its output (through linear ops) and the stream it read (through
    ops without weight matrices: a norm in the caller's forward): a residual add in the caller, as in
    ``for f in self.blocks: h = h + f(h)``. ``accept`` (default: the call's output) marks the branch."""
    accept = accept or (lambda n: n is call.output)
    stream, todo = set(), [call.passed or call.source]
    while todo and len(stream) < 256:  # the stream before the call: back through weightless ops
        node = todo.pop()
        if id(node) not in stream:
            stream.add(id(node))
            todo += [p for p in node.parents if not node.weight]
    branch = set()
    for node in recorder.nodes[call.start:]:
        if accept(node):
            branch.add(id(node))
        taken = [p for p in node.parents if id(p) in branch]
        if not taken:
            continue
        others = [p for p in node.parents if id(p) not in branch]
        if node.op in ADDS and len(others) == 1 and id(others[0]) in stream:
            return node
        if (node.op in LINEAR and not others) or node.op in PRODUCTS and len(taken) == 1 or node.op in ADDS:
            branch.add(id(node))
    return None
