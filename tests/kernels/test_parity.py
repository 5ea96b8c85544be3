"""The two kernels give the same step: the C++ kernel and the plain torch path, through the optimizer, on
every geometry the C++ kernel covers, for every dtype, stride and magnitude case it accepts (rows of zeros,
of subnormals, of tiny and of huge values beside ordinary ones), with momentum, Nesterov and decay.

The plain path's fast row(2) / col(2) pass gave rows whose norm lay outside [1.1e-16, 1.8e19] a zero
update (and counted no skip) where the C++ kernel steps them exactly.
"""

import pytest
import torch

from moga.kernels import FusedCalls
from moga.optim import GeometryOptimizer

SPECS = ["row(p=2)", "row(p=1.5)", "row(p=2.5)", "row(p=3.2)", "col(q=2)", "col(q=3)", "sign", "embedding(q=2)"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]  # bfloat16 with bfloat16 state: the kernel's own case
# Per line (the rows or columns the geometry normalizes): the scale of its gradient. A None entry: half the
# line ordinary, half subnormal. 32-bit types share float32's exponent range; float64 goes further.
MAGNITUDES = {
    torch.float32: [1.0, 1e-30, 1e25, 0.0, None, 1e-19, 5e37, 1e-17, 1e20],
    torch.float64: [1.0, 1e-200, 1e200, 0.0, None, 1e-160, 1e300, 1e-150, 1e160],
}
SUBNORMAL = {torch.float32: 1e-40, torch.float64: 1e-310}
# (rtol, atol as a fraction of the largest |value|): a few roundings apart, where the bug was a whole step
# (~1.6e-3 per weight of ~0.02 here). In bfloat16 the plain path rounds twice a step (decay, then update)
# where the kernel rounds once, and column mode re-reads the rounded momentum: a weight near zero can be an
# ulp of its larger intermediate apart.
TOL = {torch.float64: (1e-13, 1e-14), torch.float32: (1e-6, 1e-7), torch.bfloat16: (2**-6, 2**-7)}


def assert_near(got, expected, dtype, where, elementwise=False):
    """Weights within a few roundings of the largest; momentum (an elementwise EMA) of each value."""
    rtol, atol = TOL[dtype]
    atol = torch.finfo(dtype).tiny if elementwise else atol * float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=where)


def lines_scaled(g, dtype, axis):
    """``g`` (float64) with each slice along ``axis`` (the normalized lines) scaled by the next magnitude."""
    scales = MAGNITUDES[torch.float64 if dtype == torch.float64 else torch.float32]
    g = g.movedim(axis, 0).clone()
    for i in range(g.shape[0]):
        scale = scales[i % len(scales)]
        if scale is None:
            line = g[i]
            line[torch.arange(line.numel()).reshape(line.shape) < line.numel() // 2] *= SUBNORMAL[
                torch.float64 if dtype == torch.float64 else torch.float32]
        else:
            g[i] *= scale
    return g.movedim(0, axis)


def cases(spec):
    """(what, make the parameter from float64 values, layout, axis of the normalized lines)."""
    embedding = spec.startswith("embedding")
    along = 1 if spec.startswith("col") else 0  # col normalizes columns: lines are the stored columns
    two_d = "io" if embedding else "oi"
    yield "matrix", lambda v: v, (9, 64), two_d, 0 if embedding else along
    yield "single row", lambda v: v, (1, 40), two_d, 0 if embedding else along
    yield "single column", lambda v: v, (40, 1), two_d, 0 if embedding else along
    # size-1 dims with odd strides are still contiguous to the kernel
    yield "odd size-1 stride", lambda v: v.t().contiguous().t(), (40, 1), two_d, 0 if embedding else along
    yield "view at an offset", lambda v: torch.cat([torch.zeros(3, v.shape[1], dtype=v.dtype), v])[3:], (9, 64), \
        two_d, 0 if embedding else along
    if not embedding:
        yield "stack of matrices", lambda v: v, (3, 9, 17), "boi", 1 + along


def run(spec, dtype, kernel, make, shape, layout, axis, momentum, nesterov, wd):
    gen = torch.Generator().manual_seed(0)
    values = 0.02 * torch.randn(shape, generator=gen, dtype=torch.float64)  # weights of a GPT-2 size
    w = torch.nn.Parameter(make(values.to(dtype)))
    opt = GeometryOptimizer([{"params": [w], "layout": layout}], lr=0.1, momentum=momentum, nesterov=nesterov,
                            weight_decay=wd, geometry=spec, kernel=kernel,
                            state_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    stepped = 0
    for _ in range(2):
        w.grad = lines_scaled(torch.randn(shape, generator=gen, dtype=torch.float64), dtype, axis).to(dtype)
        with FusedCalls() as calls:
            opt.step()
        stepped += calls.stepped
    return w.detach(), opt.state[w].get("momentum_buffer"), opt.skipped_steps, stepped


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_cpp_kernel_and_plain_path_give_the_same_step(spec, dtype):
    for what, make, shape, layout, axis in cases(spec):
        for momentum, nesterov, wd in [(0.0, False, 0.0), (0.9, True, 0.1)]:
            where = f"{spec} {dtype} {what} {shape} momentum={momentum} nesterov={nesterov} wd={wd}"
            args = (make, shape, layout, axis, momentum, nesterov, wd)
            w_cpp, m_cpp, skipped_cpp, stepped_cpp = run(spec, dtype, "cpp", *args)
            w_torch, m_torch, skipped_torch, stepped_torch = run(spec, dtype, "torch", *args)
            assert (stepped_cpp, stepped_torch) == (2, 0), where  # each path really ran
            assert skipped_cpp == skipped_torch == 0, where
            assert torch.isfinite(w_cpp).all() and torch.isfinite(w_torch).all(), where
            assert_near(w_cpp, w_torch, dtype, where)
            if momentum:
                assert_near(m_cpp, m_torch, dtype, where, elementwise=True)
