"""moga.optim.functional is the reference: the optimizer's plain path is it, bit for bit, and the fused C++
kernel and the compiled kernel's step equal it to roundoff, for every geometry, with momentum, Nesterov and
weight decay (FSDP2 shards against it: test_sharded). The frames from step() to the formula: test_budgets."""

import pytest
import torch

from moga.geometry import parse_geometry
from moga.kernels import plan, reference
from moga.layout import resolve_layout
from moga.optim import GeometryOptimizer, functional

SPECS = ["row(p=2)", "row(p=1.5)", "row(p=3)", "col(q=2)", "col(q=3)", "sign", "embedding(q=2)", "vector",
         "spectral", "row(p=inf)"]
# momentum > 1/2: a skippable step's EMA is torch's fused SGD kernel, which rounds as lerp does only for
# weights 1 - momentum below 1/2 (at or above, lerp computes from the other end: one ulp apart)
HYPER = [(0.0, False, 0.0), (0.9, False, 0.1), (0.9, True, 0.0), (0.6, True, 0.3)]


def steps(spec, dtype, kernel, momentum, nesterov, wd, nonfinite="skip", n=3):
    """(weights, momentum) after n optimizer steps, and the same through functional.lmo_step_."""
    gen = torch.Generator().manual_seed(0)
    shape = (6,) if spec == "vector" else (9, 13)
    w = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
    ref = w.detach().clone()
    opt = GeometryOptimizer([w], lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd, geometry=spec,
                            kernel=kernel, nonfinite=nonfinite)
    geometry = parse_geometry(spec)
    layout = resolve_layout(None, ref) if geometry.matrix else None
    m = torch.zeros_like(ref) if momentum else None
    for _ in range(n):
        w.grad = torch.randn(shape, generator=gen, dtype=dtype)
        opt.step()
        functional.lmo_step_(ref, w.grad, m, geometry=geometry, layout=layout, lr=0.1, momentum=momentum,
                             nesterov=nesterov, weight_decay=wd)
    return (w.detach(), opt.state[w].get("momentum_buffer")), (ref, m)


@pytest.mark.parametrize("nonfinite", ["skip", "ignore"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec", SPECS)
def test_the_plain_path_is_functional_bit_for_bit(spec, dtype, nonfinite):
    for momentum, nesterov, wd in HYPER:
        (w, m), (w_ref, m_ref) = steps(spec, dtype, "torch", momentum, nesterov, wd, nonfinite)
        where = f"{spec} {dtype} momentum={momentum} nesterov={nesterov} wd={wd} nonfinite={nonfinite}"
        assert torch.equal(w, w_ref), where
        assert m is None if not momentum else torch.equal(m, m_ref), where


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec", ["row(p=2)", "row(p=1.5)", "row(p=3)", "col(q=2)", "col(q=3)", "sign",
                                  "embedding(q=2)"])
def test_the_fused_kernel_equals_functional(spec, dtype):
    tol = {torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
    for momentum, nesterov, wd in HYPER:
        (w, m), (w_ref, m_ref) = steps(spec, dtype, "cpp", momentum, nesterov, wd)
        where = f"{spec} {dtype} momentum={momentum} nesterov={nesterov} wd={wd}"
        torch.testing.assert_close(w, w_ref, rtol=0, atol=tol, msg=where)
        if momentum:
            torch.testing.assert_close(m, m_ref, rtol=0, atol=tol, msg=where)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec", ["row(p=2)", "row(p=1.5)", "col(q=3)", "sign", "embedding(q=2)"])
def test_the_compiled_kernels_step_equals_functional(spec, dtype):
    """kernels.reference.tensor_step_ (what torch.compile turns into the CUDA kernel, here in eager) on the
    (B, K, N) view the geometry's kernel plan gives, against the readable step on the tensor itself."""
    tol = {torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
    geometry = parse_geometry(spec)
    for momentum, nesterov, wd in HYPER:
        gen = torch.Generator().manual_seed(1)
        w, g, m = (torch.randn(9, 13, generator=gen, dtype=dtype) for _ in range(3))
        layout = resolve_layout(None, w)
        shape, p, factor = plan(geometry, layout, w.shape)
        kw, km = w.clone(), m.clone() if momentum else None
        reference.tensor_step_(kw, g, km, None, tuple(shape), -0.1 * factor, p, momentum, nesterov, 1 - 0.1 * wd)
        fm = m.clone() if momentum else None
        functional.lmo_step_(w, g, fm, geometry=geometry, layout=layout, lr=0.1, momentum=momentum,
                             nesterov=nesterov, weight_decay=wd)
        torch.testing.assert_close(kw, w, rtol=0, atol=tol)
        if momentum:
            torch.testing.assert_close(km, fm, rtol=0, atol=tol)


def test_normuon_moment_on_split_replicated_steps_is_refused(monkeypatch):
    """Under DDP one rank orthogonalizes each matrix and shares the result: the other ranks' copies of NorMuon's
    per-row second moment would go stale, so the step refuses rather than silently dropping the moment, before
    any group changes (the world is what a DDP run's two ranks would report)."""
    from moga.optim import sharded

    monkeypatch.setattr(sharded, "replicated_world", lambda distributed: True)
    w, v = torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(3, 4))
    opt = GeometryOptimizer([{"params": [v], "geometry": "row"}, {"params": [w]}], lr=0.1, momentum=0.9,
                            weight_decay=0.5, geometry="spectral_row(beta2=0.95)", kernel="torch")
    w.grad, v.grad = torch.ones(3, 4), torch.ones(3, 4)
    with pytest.raises(ValueError, match="distributed=False"):
        opt.step()
    assert torch.equal(w, torch.ones(3, 4)) and torch.equal(v, torch.ones(3, 4))  # nothing decayed or stepped
    assert not any(opt.state[p] for p in (v, w))  # no momentum taken
