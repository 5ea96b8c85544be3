"""Inverse-depth residual scaling: ``y_k = y_{k-1} + alpha * f_k(y_{k-1})`` with ``alpha = beta / K``.

With this scaling the loss's Lipschitz and smoothness constants in the block norm do not depend on the
depth ``K``, so a learning rate tuned at a reference depth ``K_base`` needs no depth correction
(docs/math.md §4; [depth], Definition 1 and Theorems 1-2). ``beta`` defaults to ``K_base``
(``alpha = K_base / K``, ``K_base = 2`` in the paper's figure 1), so at ``K = K_base`` the network is the
unscaled one. ``mode="none"`` gives ``alpha = 1``, the unscaled baseline.

What ``K`` counts (``K_base`` is counted in the same unit):

- residual MLP: its two-linear-layer branches, one per block;
- ResNet: residual blocks (BasicBlock or Bottleneck): 8, 16, 32 for stages [2,2,2,2], [3,4,6,3],
  [8,8,8,8]. Projection shortcuts are not branches and are never scaled;
- GPT (this project's ``Block``, Hugging Face's ``GPT2Block``): transformer blocks, ``n_layer``. Both
  sub-blocks of a block (attention and MLP) are branches and get the same ``alpha = beta / n_layer``.
  Counting sub-blocks (``K = 2 n_layer``) would only halve ``alpha`` at every depth, a constant that
  ``beta = Theta(1)`` absorbs; counting blocks matches the depths the paper's GPT-2 sweep reports
  (2..128) and makes ``K_base`` "the ``n_layer`` the learning rate was tuned at".
- feedforward and shared-weights nets have no residual branches, so nothing is scaled.

How it is applied, to any model and without editing its code: each branch module gets a child
:class:`ResidualScale` (``<branch>.residual_scale``) and a forward hook that multiplies the branch's
output by that child's ``alpha``. So the scaling

- is part of the module tree: it shows in ``print(model)``, is copied by ``copy.deepcopy`` and pickled
  by ``torch.save(model)``, and nothing is stored on tensors (which loses it, microsoft/mup#59);
- is in ``state_dict`` as ``<branch>.residual_scale._extra_state = {"alpha": ...}``: loading a checkpoint
  restores the alpha it was saved with. Scale the receiving model first (any alpha); a strict load of
  a scaled checkpoint into an unscaled model fails on these keys, rather than silently changing the
  function. Parameter names are unchanged, so unscaled checkpoints load with ``strict=False``;
- can be removed: ``handle.remove()`` or :func:`remove_residual_scaling` (which also works on copies).

Branches are found from the forward, not from class names (``moga.depth.trace``): one probe forward is
recorded op by op, the blocks are the outermost elements of ``ModuleList``/``Sequential`` containers
whose forward adds something to its own input, and a block's branches are the modules whose outputs
those adds take (the outermost submodule with parameters that returned it, through dropout, casts and
sums). A module with a ``residual_branches()`` method (this project's blocks) names its own. K counts
blocks: for encoder-decoders (T5, Whisper) and two-tower models (CLIP), the blocks of both stacks.
``branches=`` names them by hand (glob patterns or modules); K is then yours to give (``depth=``).

Every call proves what it did (``verify=True``), on a probe input (``moga.depth.probe``: derived from
the model, or ``example_input=``), in the model's eval mode and without gradients:

1. an unscaled forward, recorded: each block's input and output;
2. the same block inputs with every branch scaled by a probe alpha (the given alpha when it lies in
   [2^-8, 2^-4], else 2^-4: near 1 a misplaced scale cannot be told from a right one; 2^-2 for models
   with 16-bit floating parameters, whose rounding hides smaller branches), recorded: every
   residual add must take its branch through linear ops from a scaled output (so a norm after the scaled
   module, as Gemma2's post-norms, is an error), and no scale may sit on the residual stream itself (as
   Bloom's ``self_attention``, which adds the residual inside);
3. the same inputs with the branches scaled by 0. Each block's contribution, its output at alpha minus
   its output at 0, must be alpha times the unscaled one, within a factor of ``1/sqrt(alpha)`` in norm:
   halfway, in log scale, between a right scale (ratio 1) and one that does nothing (ratio 1/alpha, a
   norm after it) or acts twice (ratio alpha). Not exactly alpha: a later branch of a block sees an input
   the earlier ones changed, and a nonlinearity after the add (a post-activation ResNet's ReLU) bends the
   contribution: a CIFAR ResNet-66 block measured 2.04 at 2^-2, which the old factor 2 refused.

Any failure raises, naming the block and what was measured, and leaves the model as it was. The ratios
are in ``ResidualScaling.measured``. On the meta device (shapes, no values) only step 2 runs.
``verify=False`` skips the probe, for models whose blocks contribute nothing yet (zero-initialized
branches) or that cannot run a forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from moga.depth.find import blocks_of, declared_blocks, find, none_found, probe_mode, resolve
from moga.depth.probe import example_call
from moga.depth.scale import (
    MODES,
    SCALE_NAME,
    ResidualScale,
    attach,
    check_positive,
    detach,
    remove_residual_scaling,
    residual_alpha,
    residual_scales,
)
from moga.depth.verify import probe_alpha, prove, tolerance

__all__ = [
    "MODES", "SCALE_NAME", "ResidualScale", "ResidualScaling", "remove_residual_scaling", "residual_alpha",
    "residual_blocks", "residual_scales", "scale_residual_branches", "tolerance",
]


@dataclass
class ResidualScaling:
    """What :func:`scale_residual_branches` did; ``remove()`` undoes it. ``measured``: block -> its
    contribution's ratio (scaled / unscaled) over the probe's alpha, 1 being exact (empty if not verified)."""

    model: nn.Module = field(repr=False)
    branches: tuple[str, ...]
    alpha: float
    depth: int | None
    blocks: tuple[str, ...] = ()
    measured: dict[str, float] = field(default_factory=dict)
    probe_alpha: float | None = None

    def remove(self) -> None:
        for name in self.branches:
            detach(self.model.get_submodule(name))


def scale_residual_branches(
    model: nn.Module,
    alpha: float | None = None,
    *,
    branches: Iterable[str | nn.Module] | None = None,
    depth: int | None = None,
    mode: str = "inverse_depth",
    k_base: float = 2,
    beta: float | None = None,
    example_input=None,
    verify: bool = True,
) -> ResidualScaling:
    """Scale every residual branch of ``model`` by ``alpha``, in place, and prove it on a probe input.

    ``alpha`` defaults to ``residual_alpha(depth, mode, k_base, beta)``, where ``depth`` defaults to the
    number of residual blocks found. ``branches`` names the branch modules (glob patterns over module
    names, or the modules themselves) instead of finding them; then ``depth`` or ``alpha`` must be given,
    since only you know what K counts. A branch already scaled gets the new alpha (alpha is set, never
    multiplied). ``example_input`` (a tensor, a tuple of arguments or a dict of keyword arguments) is the
    probe input when the model's cannot be derived (see ``moga.depth.probe``). The probe (module
    docstring) raises if any block's contribution does not shrink by alpha; ``verify=False`` skips it.
    """
    if branches is not None and alpha is None and depth is None:
        raise ValueError("with explicit branches, give depth=K (for a transformer, K counts blocks, not "
                         "attention and MLP sub-blocks; see moga.depth) or alpha")
    if alpha is not None:
        check_positive("alpha", alpha)
    if not verify:
        if branches is None:
            blocks = declared_blocks(model)
            if not blocks:
                raise ValueError(f"verify=False finds branches only from residual_branches() methods, and "
                                 f"{type(model).__name__} has none: name them with branches=")
            targets = [name for names in blocks.values() for name in names]
            depth = len(blocks) if depth is None else depth
        else:
            blocks, targets = {}, resolve(model, branches)
        alpha = residual_alpha(depth, mode, k_base, beta) if alpha is None else float(alpha)
        return ResidualScaling(model, tuple(attach(model, targets, alpha)), alpha, depth, tuple(blocks))

    with probe_mode(model):
        args, kwargs = example_call(model, example_input)
        found, unscaled, problems = find(model, args, kwargs)
        if branches is None:
            blocks = {b: names for b, names in found.items() if names}
            if not blocks:
                raise ValueError(none_found(model, problems))
            targets = [name for names in blocks.values() for name in names]
            depth = len(blocks) if depth is None else depth
        else:
            targets = resolve(model, branches)
            blocks = blocks_of(model, targets, found)
        alpha = residual_alpha(depth, mode, k_base, beta) if alpha is None else float(alpha)
        probe = probe_alpha(model, alpha)
        before = set(residual_scales(model))
        scaled = attach(model, targets, probe)
        try:
            measured = prove(model, args, kwargs, blocks, scaled, unscaled, probe)
        except Exception:  # leave the model as it was: new scales go, old ones get their alpha back on exit
            for name in scaled:
                if name not in before:
                    detach(model.get_submodule(name))
            raise
    for name in scaled:
        getattr(model.get_submodule(name), SCALE_NAME).alpha = alpha
    return ResidualScaling(model, tuple(scaled), alpha, depth, tuple(blocks), measured, probe)


def residual_blocks(model: nn.Module, example_input=None, declared: bool = True) -> dict[str, list[str]]:
    """Block name -> names of its branch modules, found from one probe forward of ``model`` (see
    ``moga.depth.trace``); blocks with a ``residual_branches()`` method name their own unless
    ``declared=False``."""
    with probe_mode(model):
        found, _, _ = find(model, *example_call(model, example_input), declared)
    return {b: names for b, names in found.items() if names}

