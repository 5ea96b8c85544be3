"""docs/math.md §3.1's step written out with plain torch ops, one parameter at a time: the reference the
optimizers' fused and foreach paths are tested against."""

import torch

from moga.geometry import parse_geometry
from moga.layout import resolve_layout


class ReferenceStep:
    """Steps the parameters of ``param_groups`` (an optimizer's, whose own ``step`` is not called):
    ``G <- m G + (1 - m) g`` (Nesterov: ``lerp(g, G, m)``), ``W <- (1 - lr*wd) W + lr * lmo(G)``; Adam
    groups take torch.optim.AdamW's formulas with ``lr * c``, ``c`` the sign geometry's factor."""

    def __init__(self, param_groups):
        self.groups = param_groups
        self.state = {}

    @torch.no_grad()
    def step(self):
        for group in self.groups:
            geometry = parse_geometry(group["geometry"])
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                layout = resolve_layout(group["layout"], p) if geometry.matrix else None
                st = self.state.setdefault(p, {})
                p.mul_(1 - lr * wd)
                if group["update"] == "adam":
                    b1, b2 = group["betas"]
                    st["t"] = st.get("t", 0) + 1
                    m = st["m"] = st.get("m", torch.zeros_like(p)) * b1 + (1 - b1) * g
                    v = st["v"] = st.get("v", torch.zeros_like(p)) * b2 + (1 - b2) * g * g
                    m_hat, v_hat = m / (1 - b1 ** st["t"]), v / (1 - b2 ** st["t"])
                    c = geometry.sign_scale(p.shape, layout)
                    p.sub_(lr * c * m_hat / (v_hat.sqrt() + group["eps"]))
                    continue
                d = g
                if group["momentum"] > 0:
                    mom = group["momentum"]
                    d = st["G"] = mom * st.get("G", torch.zeros_like(p)) + (1 - mom) * g
                    if group["nesterov"]:
                        d = torch.lerp(g, d, mom)
                p.add_(lr * geometry.lmo(d, layout))
