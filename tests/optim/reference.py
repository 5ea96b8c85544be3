"""The optimizers' param groups stepped by :mod:`moga.optim.functional`, one tensor at a time: the reference
the optimizers' fused and foreach paths are tested against."""

import torch

from moga.geometry import parse_geometry
from moga.layout import resolve_layout
from moga.optim import functional


class ReferenceStep:
    """Steps the parameters of ``param_groups`` (an optimizer's, whose own ``step`` is not called) with
    :func:`functional.lmo_step_` or :func:`functional.adam_step_`, in float32 or float64 like the parameters."""

    def __init__(self, param_groups):
        self.groups = param_groups
        self.state = {}

    def zero_grad(self):
        for group in self.groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self):
        for group in self.groups:
            geometry = parse_geometry(group["geometry"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                layout = resolve_layout(group["layout"], p) if geometry.matrix else None
                st = self.state.setdefault(p, {})
                hyper = dict(lr=group["lr"], weight_decay=group["weight_decay"])
                if group["update"] == "adam":
                    st["t"] = st.get("t", 0) + 1
                    m, v = st.setdefault("m", torch.zeros_like(p)), st.setdefault("v", torch.zeros_like(p))
                    functional.adam_step_(p, p.grad, m, v, st["t"], scale=geometry.sign_scale(p.shape, layout),
                                          betas=group["betas"], eps=group["eps"], **hyper)
                else:
                    m = st.setdefault("G", torch.zeros_like(p)) if group["momentum"] > 0 else None
                    if geometry.stateful:
                        hyper["moment"] = st.setdefault("V", p.new_zeros(geometry.state_shape(p.shape, layout)))
                    functional.lmo_step_(p, p.grad, m, geometry=geometry, layout=layout, momentum=group["momentum"],
                                         nesterov=group["nesterov"], **hyper)
