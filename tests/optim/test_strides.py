"""Parameters and gradients with any strides step as the readable reference does: a transposed parameter, a
channels_last conv kernel, a gradient assigned with other strides than its parameter's. torch's fused
kernels walk memory in order and ignore strides, so they must only see tensors laid out alike."""

import pytest
import torch

from moga.optim import MOGA, Muon, ScaledAdamW

from .reference import ReferenceStep

OPTIMIZERS = {
    "row(p=2)": lambda ps, kernel: MOGA(ps, lr=0.1, weight_decay=0.1, geometry="row(p=2)", kernel=kernel),
    "row(p=1.5)": lambda ps, kernel: MOGA(ps, lr=0.1, nesterov=True, geometry="row(p=1.5)", kernel=kernel),
    "col(q=2)": lambda ps, kernel: MOGA(ps, lr=0.1, geometry="col(q=2)", kernel=kernel),
    "sign": lambda ps, kernel: MOGA(ps, lr=0.1, geometry="sign", kernel=kernel),
    "embedding(q=2)": lambda ps, kernel: MOGA(ps, lr=0.1, geometry="embedding(q=2)", kernel=kernel),
    "ScaledAdamW": lambda ps, kernel: ScaledAdamW(ps, lr=0.1, weight_decay=0.1, kernel=kernel),
    "Muon": lambda ps, kernel: Muon(ps, lr=0.1, method="svd", kernel=kernel),  # exact polar factor
}


def transposed(gen):
    return torch.randn(12, 8, generator=gen, dtype=torch.float64).t()  # (8, 12), strides (1, 8)


def channels_last(gen):
    return torch.randn(6, 4, 3, 3, generator=gen, dtype=torch.float64).to(memory_format=torch.channels_last)


def contiguous(t, gen):
    return torch.randn(t.shape, generator=gen, dtype=t.dtype)


def like_param(t, gen):
    return torch.empty_like(t).copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))  # the same strides


def reversed_dims(t, gen):
    """A gradient whose memory runs through the dims in reverse order (neither the parameter's nor row-major)."""
    dims = list(range(t.ndim))[::-1]
    return torch.randn([t.shape[d] for d in dims], generator=gen, dtype=t.dtype).permute(*dims)


def every_other_column(gen):
    return torch.randn(8, 24, generator=gen, dtype=torch.float64)[:, ::2]  # a view with gaps: not dense


PARAMS = {"transposed": (transposed, "oi"), "channels_last": (channels_last, "oiii"),
          "every other column": (every_other_column, "oi"),
          "contiguous": (lambda gen: torch.randn(8, 12, generator=gen, dtype=torch.float64), "oi")}
GRADS = {"contiguous": contiguous, "like_param": like_param, "reversed_dims": reversed_dims}


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_strided_parameters_and_gradients_step_as_the_reference(name, kernel):
    for param_case, (make_param, layout) in PARAMS.items():
        if name == "embedding(q=2)" and layout != "oi":
            continue
        for grad_case, make_grad in GRADS.items():
            gen = torch.Generator().manual_seed(0)
            w = torch.nn.Parameter(make_param(gen))
            w_ref = torch.nn.Parameter(w.detach().clone())  # the reference does not care about strides
            opt = OPTIMIZERS[name]([{"params": [w], "layout": layout}], kernel)
            reference = ReferenceStep(OPTIMIZERS[name]([{"params": [w_ref], "layout": layout}], "torch").param_groups)
            for _ in range(3):
                g = make_grad(w, gen)
                w.grad, w_ref.grad = g, g.contiguous()
                opt.step()
                reference.step()
            where = f"{name} kernel={kernel}: {param_case} parameter, {grad_case} gradient"
            torch.testing.assert_close(w.detach(), w_ref.detach(), rtol=0, atol=1e-12, msg=where)
            state_key = "exp_avg" if name == "ScaledAdamW" else "momentum_buffer"
            ref_key = "m" if name == "ScaledAdamW" else "G"
            torch.testing.assert_close(opt.state[w][state_key], reference.state[w_ref][ref_key], rtol=0, atol=1e-12,
                                       msg=where)
