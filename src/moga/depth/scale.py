"""The scale itself: ``ResidualScale``, a child module whose forward hook multiplies a branch's output by
``alpha``, and attaching, finding and removing it (see ``moga.depth``)."""

from __future__ import annotations

import math

from torch import nn

MODES = ("inverse_depth", "none")
SCALE_NAME = "residual_scale"


def residual_alpha(depth: int, mode: str = "inverse_depth", k_base: float = 2, beta: float | None = None) -> float:
    """``beta / depth`` (``beta`` defaults to ``k_base``) for ``mode="inverse_depth"``; 1.0 for ``"none"``."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth (K, the number of residual blocks) must be an integer >= 1, got {depth!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} ('none' is the unscaled alpha = 1), got {mode!r}")
    check_positive("k_base", k_base)
    if beta is not None:
        check_positive("beta", beta)
    if mode == "none":
        return 1.0
    return float(k_base if beta is None else beta) / depth


class ResidualScale(nn.Module):
    """Multiplies a residual branch's output by ``alpha``; ``alpha`` travels in ``state_dict``."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = check_positive("alpha", alpha)

    def forward(self, output):
        if isinstance(output, tuple):  # Hugging Face attention: (output, weights, ...)
            return (output[0] * self.alpha, *output[1:])
        return output * self.alpha

    # A float, not a buffer: it keeps its value under .half() and is not a tensor to optimize.
    def get_extra_state(self) -> dict:
        return {"alpha": self.alpha}

    def set_extra_state(self, state: dict) -> None:
        self.alpha = check_positive("alpha", state["alpha"])

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:g}"


def _apply_scale(module: nn.Module, args, output):
    # A plain function looked up by name at call time, so deepcopy and pickling keep it pointing at the
    # copy's own ResidualScale.
    return getattr(module, SCALE_NAME)(output)


def remove_residual_scaling(model: nn.Module) -> list[str]:
    """Remove every residual scale from ``model`` (and from copies of it); returns the branch names."""
    names = list(residual_scales(model))
    for name in names:
        detach(model.get_submodule(name))
    return names


def residual_scales(model: nn.Module) -> dict[str, float]:
    """Branch name -> alpha, for every scaled branch of ``model``."""
    return {
        name: getattr(m, SCALE_NAME).alpha
        for name, m in model.named_modules() if isinstance(getattr(m, SCALE_NAME, None), ResidualScale)
    }


def attach(model: nn.Module, targets: list[str], alpha: float) -> list[str]:
    scaled = []
    for name in targets:
        name, module = _output_module(model, name)
        existing = getattr(module, SCALE_NAME, None)
        if isinstance(existing, ResidualScale):
            existing.alpha = alpha
        elif existing is not None:
            raise ValueError(f"{name or type(model).__name__} already has an attribute {SCALE_NAME!r}")
        else:
            module.add_module(SCALE_NAME, ResidualScale(alpha))
            module.register_forward_hook(_apply_scale)
        if name not in scaled:
            scaled.append(name)
    return scaled



def _output_module(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """The module whose output is the branch's output: a Sequential's is its last module's."""
    module = model.get_submodule(name)
    while isinstance(module, nn.Sequential) and len(module):
        name = f"{name}.{len(module) - 1}" if name else str(len(module) - 1)
        module = module[-1]
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise TypeError(f"branch {name!r} is a {type(module).__name__}, which has no forward; name its modules")
    return name, module


def detach(module: nn.Module) -> None:
    # What RemovableHandle.remove() does, found by the hook function so that copies can be cleaned too.
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook is _apply_scale:
            del module._forward_hooks[hook_id]
            module._forward_hooks_with_kwargs.pop(hook_id, None)
            module._forward_hooks_always_called.pop(hook_id, None)
    if isinstance(getattr(module, SCALE_NAME, None), ResidualScale):
        delattr(module, SCALE_NAME)


def check_positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
