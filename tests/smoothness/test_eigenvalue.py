"""The Euclidean top eigenvalue from HVPs against a dense Hessian of a tiny net."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

from moga.smoothness import HessianOperator, euclidean_top_eigenvalue, hessian_top_eigenvalue


def _tiny():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3))
    gen = torch.Generator().manual_seed(1)
    batch = torch.randn(20, 4, generator=gen), torch.randint(0, 3, (20,), generator=gen)
    return net, batch


def _loss(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _dense_hessian(net, batch):
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for _, p in net.named_parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def loss_of(flat):
        params, start = {}, 0
        for name, shape in zip(names, shapes):
            params[name] = flat[start:start + shape.numel()].view(shape)
            start += shape.numel()
        return _loss(lambda x: functional_call(net, params, (x,)), batch)

    H = torch.autograd.functional.hessian(loss_of, flat0)
    assert H.shape == (flat0.numel(), flat0.numel()) and flat0.numel() < 100
    return H


def test_power_and_lanczos_match_the_dense_hessian():
    net, batch = _tiny()
    H = _dense_hessian(net, batch)
    eig = torch.linalg.eigvalsh((H + H.T) / 2)
    top = float(eig[eig.abs().argmax()])

    hess = HessianOperator(net, _loss, batch, list(net.parameters()))
    v = torch.randn(hess.numel, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(hess.matvec(v), H @ v, rtol=1e-10, atol=1e-12)  # same operator
    lanczos = hessian_top_eigenvalue(hess, iters=hess.numel, method="lanczos", tol=1e-12)
    assert lanczos.largest == pytest.approx(float(eig[-1]), rel=1e-9)
    assert lanczos.smallest == pytest.approx(float(eig[0]), rel=1e-9, abs=1e-9)
    assert lanczos.value == pytest.approx(top, rel=1e-9) and lanczos.converged
    assert lanczos.hvps == lanczos.iterations < hess.numel - 1  # converged early

    power = euclidean_top_eigenvalue(net, _loss, batch, iters=2000, method="power", tol=1e-12)
    assert power.value == pytest.approx(top, rel=1e-6) and power.converged
    assert power.hvps == power.iterations


def test_bad_method():
    net, batch = _tiny()
    with pytest.raises(ValueError, match="method"):
        euclidean_top_eigenvalue(net, _loss, batch, method="arnoldi")
