"""The fused C++ step equals the plain geometry path (and the readable reference beside it): every
geometry it covers, every fast-path p and a generic one, odd and degenerate shapes, extreme magnitudes,
momentum, Nesterov and weight decay; resume is bitwise; torch.compile sees the custom op.

The one-time JIT build is shared by the session (``built`` fixture); it takes ~30 s of CPU on a
free core (minutes of wall time on a busy machine), once per machine: later runs load it from the cache.
"""

import copy
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moga.geometry import parse_geometry
from moga.kernels import fused_lmo_step_, plan, reference
from moga.kernels.build import load_extension
from moga.layout import resolve_layout
from moga.optim import MOGA, GeometryOptimizer

SPECS = ["row(p=2)", "row(p=1.5)", "row(p=2.5)", "row(p=3.2)", "col(q=2)", "col(q=3)", "sign", "embedding(q=2)"]
SHAPES = [(7, 13), (1, 40), (40, 1), (33, 257), (130, 9), (3, 4, 5)]  # (130, 9): five column chunks, the last short
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


@pytest.fixture(scope="session")
def built():
    from moga.kernels import ops  # noqa: F401  (registers torch.ops.moga.*, whichever test runs first)

    return load_extension()


def layout_for(spec, shape):
    if len(shape) == 3:
        return "boi"
    return "io" if spec.startswith("embedding") else "oi"


def make(spec, shape, dtype, kernel, momentum, nesterov, wd, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
    opt = GeometryOptimizer([{"params": [w], "layout": layout_for(spec, shape)}], lr=0.1, momentum=momentum,
                            nesterov=nesterov, weight_decay=wd, geometry=spec, kernel=kernel)
    return w, opt, gen


def run_steps(spec, shape, dtype, kernel, momentum, nesterov, wd, steps=2):
    w, opt, gen = make(spec, shape, dtype, kernel, momentum, nesterov, wd)
    for _ in range(steps):
        w.grad = torch.randn(shape, generator=gen, dtype=dtype)
        opt.step()
    buf = opt.state[w].get("momentum_buffer")
    return w.detach(), buf


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("spec", SPECS)
def test_kernel_equals_plain_path(built, spec, dtype):
    for shape in SHAPES:
        for momentum, nesterov, wd in [(0.0, False, 0.0), (0.9, False, 0.1), (0.9, True, 0.0), (0.3, True, 0.5)]:
            w_cpp, m_cpp = run_steps(spec, shape, dtype, "cpp", momentum, nesterov, wd)
            w_ref, m_ref = run_steps(spec, shape, dtype, "torch", momentum, nesterov, wd)
            where = f"{spec} {tuple(shape)} {dtype} momentum={momentum} nesterov={nesterov} wd={wd}"
            torch.testing.assert_close(w_cpp, w_ref, rtol=0, atol=TOL[dtype], msg=where)
            if momentum:
                torch.testing.assert_close(m_cpp, m_ref, rtol=0, atol=TOL[dtype], msg=where)


@pytest.mark.parametrize("spec", ["row(p=2)", "col(q=2)", "sign"])
def test_empty_parameters_step(built, spec):
    for shape in [(0, 5), (5, 0)]:
        w, g, m = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
        torch.ops.moga.lmo_step_(*op_args(spec, w, g, m))  # the op itself, as the optimizer skips them
        assert w.shape == m.shape == shape


def op_args(spec, w, g, m, lr=0.1, wd=0.0, momentum=0.9, found_inf=None, layout="oi"):
    geometry = parse_geometry(spec)
    (shape, p, factor) = plan(geometry, resolve_layout(layout, w), w.shape)
    return ([w], [g], [m] if m is not None else [], found_inf, list(shape), [-lr * factor], p,
            momentum if m is not None else 0.0, False, 1 - lr * wd)


@pytest.mark.parametrize("spec", ["row(p=2)", "row(p=1.5)", "row(p=2.5)", "row(p=4)", "col(q=2)", "col(q=1.5)"])
def test_zero_rows_and_extreme_magnitudes_are_exact(built, spec):
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(8, 64, generator=gen)
    g[0] *= 1e-30
    g[1] *= 1e37
    g[2] = 0
    g[3, :32] *= 1e-40  # subnormal half row beside normal values
    g[4] *= 1e-19
    g[5, :] = 3e38
    g[6] *= 3e-16  # p = 2: in range, but its sum alone cannot show it (the kernel then looks at max |d|)
    w = torch.randn(8, 64, generator=gen)
    if spec.startswith("col"):
        g, w = g.T.contiguous(), w.T.contiguous()
    kernel, exact = w.clone(), w.double()
    torch.ops.moga.lmo_step_(*op_args(spec, kernel, g, None))
    reference.tensor_steps_(*op_args(spec, exact, g.double(), None))  # float64: nothing under- or overflows
    assert torch.isfinite(kernel).all()
    torch.testing.assert_close(kernel.double(), exact, rtol=0, atol=1e-6)
    zero = (2, slice(None)) if spec.startswith("row") else (slice(None), 2)
    assert torch.equal(kernel[zero], w[zero])  # a zero row moves by the decay only (here none)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("p", [2.0, 1.5])
@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_each_row_steps_as_it_would_alone(built, dtype, p, momentum, nesterov):
    """Rows step in a pipeline (pass B of a row in the loop of the next row's pass A), so a row's result
    must not depend on its neighbours: zero rows, rows whose sums under- or overflow and rows that need a
    second look, first and last in a thread's range, twice in a row, on one thread and on two."""
    rows, n = 2000, 40  # two threads split the rows 1000 and 1000
    tiny, huge, small = (1e-170, 1e170, 1e-150) if dtype == torch.float64 else (1e-30, 1e30, 3e-16)
    scale = torch.ones(rows, 1, dtype=torch.float64)
    for row, s in {0: 0.0, 1: tiny, 500: huge, 501: small, 502: 0.0, 999: huge, 1000: tiny, 1998: small, 1999: 0.0}.items():
        scale[row] = s
    gen = torch.Generator().manual_seed(3)
    g, m0, w0 = ((torch.randn(rows, n, generator=gen, dtype=torch.float64) * scale).to(dtype) for _ in range(3))
    lib = load_extension()

    def step(w, g, m):
        lib.lmo_step([w], [g], [m] if momentum else [], None, [w.shape[0], n, 1], [-0.1], p, momentum, nesterov,
                     1 - 0.1 * 0.1)

    alone_w, alone_m = w0.clone(), m0.clone()
    for row in range(rows):
        step(alone_w[row:row + 1], g[row:row + 1], alone_m[row:row + 1])
    assert torch.isfinite(alone_w).all()
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            w, m = w0.clone(), m0.clone()
            step(w, g, m)
            assert torch.equal(w, alone_w) and torch.equal(m, alone_m), f"{count} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("spec", ["row(p=2)", "row(p=2.5)", "col(q=2)", "sign"])
def test_bfloat16_params_do_float32_math(built, spec):
    gen = torch.Generator().manual_seed(2)
    w, g, m = (torch.randn(97, 77, generator=gen).bfloat16() for _ in range(3))  # col: 4 chunks of partial sums
    kw, km = w.clone(), m.clone()
    torch.ops.moga.lmo_step_(*op_args(spec, kw, g, km, wd=0.1))
    rw, rm = w.clone(), m.clone()
    reference.tensor_steps_(*op_args(spec, rw, g, rm, wd=0.1))  # float32 math, rounded once
    torch.testing.assert_close(km, rm, rtol=0, atol=0)
    # column mode re-reads the rounded momentum in its second sweep: at most one bfloat16 step apart
    torch.testing.assert_close(kw.float(), rw.float(), rtol=2**-7, atol=2**-7 * 1e-2)


def test_found_inf_leaves_everything_untouched(built):
    w, g, m = torch.randn(5, 9), torch.randn(5, 9), torch.randn(5, 9)
    for flag, same in [(torch.tensor(1.0), True), (torch.tensor(0.0), False)]:
        kw, km = w.clone(), m.clone()
        torch.ops.moga.lmo_step_(*op_args("row(p=2)", kw, g, km, found_inf=flag))
        assert torch.equal(kw, w) is same and torch.equal(km, m) is same


def test_nonfinite_check_is_exact(built):
    found = torch.ops.moga.found_nonfinite
    big = [torch.full((100, 100), 3e38), torch.randn(33).double(), torch.randn(8, 8).bfloat16()]
    assert found(big).item() == 0  # huge but finite: a norm would overflow, x * 0 does not
    for bad in (math.inf, -math.inf, math.nan):
        for k in range(3):
            tensors = [t.clone() for t in big]
            tensors[k].view(-1)[-1] = bad
            assert found(tensors).item() == 1


def test_nonfinite_check_covers_every_position_across_tensors(built):
    # One parallel region spans all the tensors end to end: thread ranges start and end inside tensors.
    found = torch.ops.moga.found_nonfinite
    sizes = [70001, 0, 3, 65536, 130000]
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32]
    clean = [torch.randn(n).to(dt) for n, dt in zip(sizes, dtypes)]
    assert found(clean).item() == 0
    for k, n in enumerate(sizes):
        for at in sorted({0, n // 2, n - 1} if n else set()):
            tensors = [t.clone() for t in clean]
            tensors[k][at] = math.nan if at % 2 else math.inf
            assert found(tensors).item() == 1, (k, at)


def test_skip_policy_with_the_kernel(built):
    w, opt, _ = make("row(p=2)", (6, 10), torch.float32, "cpp", 0.9, False, 0.1)
    w.grad = torch.randn(6, 10)
    opt.step()
    before, buf = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    w.grad = torch.randn(6, 10)
    w.grad[3, 4] = math.nan
    opt.step()  # skipped on the device: no host read, no warning
    assert torch.equal(w, before) and torch.equal(opt.state[w]["momentum_buffer"], buf) and opt.skipped_steps == 1


def test_resume_is_bitwise(built):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))

    def train(net, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(16, 12, generator=gen)
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()

    net_a = model()
    opt_a = MOGA(net_a, lr=0.05, nesterov=True, weight_decay=0.01, kernel="cpp")
    train(net_a, opt_a, 3, seed=1)
    state = {k: v.clone() for k, v in net_a.state_dict().items()}
    saved = copy.deepcopy(opt_a.state_dict())  # state_dict holds the live tensors
    train(net_a, opt_a, 2, seed=2)

    net_b = model()
    net_b.load_state_dict(state)
    opt_b = MOGA(net_b, lr=0.05, nesterov=True, weight_decay=0.01, kernel="cpp")
    opt_b.load_state_dict(saved)
    train(net_b, opt_b, 2, seed=2)
    for a, b in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(a, b)


def test_uncovered_parameters_take_the_plain_path(built):
    geometry = parse_geometry("row(p=2)")
    w = torch.randn(4, 6)
    strided = torch.randn(6, 4).T  # not contiguous
    rest = fused_lmo_step_(geometry, [resolve_layout("oi", w)] * 2, [w, strided], [torch.randn(4, 6)] * 2, None,
                           0.1, 0.0, False, 0.0)
    assert rest == [1]
    assert plan(parse_geometry("row(p=inf)"), resolve_layout("oi", w), w.shape) is None
    assert plan(parse_geometry("spectral"), resolve_layout("oi", w), w.shape) is None
    # an nn.Embedding table (vocab, d) normalizes its stored rows: row mode, q* = 2
    assert plan(parse_geometry("embedding(q=2)"), resolve_layout("io", w), w.shape) == ((4, 6, 1), 2.0, 6**0.5)


def test_custom_op_schema_and_fake(built):
    w, g, m = torch.randn(5, 9), torch.randn(5, 9), torch.randn(5, 9)
    torch.library.opcheck(torch.ops.moga.lmo_step_, op_args("row(p=2)", w, g, m),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiled_optimizer_step_runs_the_custom_op(built):
    def run(compiled):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        opt = MOGA(net, lr=0.05, kernel="cpp", nonfinite="ignore", vectors="sign")
        torch._dynamo.reset()
        step = torch.compile(opt.step, backend="aot_eager", fullgraph=True) if compiled else opt.step
        gen = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = net(torch.randn(4, 8, generator=gen)).square().mean()
            loss.backward()
            step()
            losses.append(loss.item())
        return losses, [p.detach() for p in net.parameters()]

    losses, params = run(compiled=True)  # fullgraph: the op is traced, not a graph break
    losses_eager, params_eager = run(compiled=False)
    assert losses == losses_eager
    for a, b in zip(params, params_eager):
        assert torch.equal(a, b)


FALLBACK = textwrap.dedent("""
    import warnings, torch
    from moga.optim import MOGA
    def run(kernel):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 6))
        opt = MOGA([w], lr=0.1, geometry="row(p=2)", kernel=kernel)
        w.grad = torch.ones(4, 6)
        opt.step()
        return w.detach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = run("auto")
        auto = run("auto")  # warned once per process
    messages = [str(w.message) for w in caught if "kernel" in str(w.message)]
    assert len(messages) == 1 and "plain torch path" in messages[0], messages
    # one line that says how to see the compiler's output, not the compiler's command line
    assert "\\n" not in messages[0] and "python -m moga.kernels.build" in messages[0] and "-O3" not in messages[0]
    assert torch.equal(auto, run("torch"))
    try:
        run("cpp")
    except RuntimeError as e:
        assert "kernel='cpp'" in str(e)
    else:
        raise AssertionError("kernel='cpp' must raise without a compiler")
    print("fallback ok")
""")


def test_auto_falls_back_when_the_compiler_fails(tmp_path):
    env = {**os.environ, "CXX": "false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "fallback ok" in result.stdout, result.stderr[-3000:]
    building = [line for line in result.stderr.splitlines() if "building the fused C++ kernel once" in line]
    assert len(building) == 1 and str(tmp_path) in building[0]  # said once, while the first build runs


def test_builds_are_keyed_by_source_not_path(built):
    from moga.kernels.build import SOURCE, build_recipe, build_tag, toolchain

    code, tools = SOURCE.read_bytes(), toolchain(["-O3"])
    assert build_tag("k", code, tools) == build_tag("k", bytes(code), list(tools))  # another checkout's copy
    assert build_tag("k", code, tools) != build_tag("k", code + b"\n", tools)  # an edited source: its own build
    # the loaded library was compiled from the copy inside its own directory, not from the checkout
    directory = build_recipe()[3]
    assert (directory / SOURCE.name).read_bytes() == code and "build.ninja" in os.listdir(directory)
    assert str(SOURCE.parent) not in (directory / "build.ninja").read_text()


def test_builds_are_keyed_by_every_path_and_flag_ninja_sees(built, monkeypatch):
    """The same source and torch in two virtualenvs: ninja's command lines differ by their include and
    library paths, so one shared directory was rebuilt on every switch (~15 s instead of 0.8 s)."""
    import shlex

    from moga.kernels.build import LDFLAGS, build_recipe, build_tag, toolchain

    name, code, flags, directory = build_recipe()
    tools = toolchain([*flags, *LDFLAGS])
    assert directory.name == build_tag(name, code, tools)
    ninja = (directory / "build.ninja").read_text()
    named = [word for line in ninja.splitlines() if line.startswith(("cflags", "ldflags", "cxx"))
             for word in shlex.split(line.split("=", 1)[1])]
    paths = [w[2:] if w.startswith(("-I", "-L")) else w for w in named
             if w.startswith(("/", "-I/", "-L/")) and "/moga_kernels" not in w]  # minus the directory itself
    assert paths and all(path in tools for path in paths), sorted(set(paths) - set(tools))
    torch_include = os.path.dirname(torch.__file__)
    elsewhere = [t.replace(torch_include, "/another/venv/torch") for t in tools]
    assert elsewhere != tools and build_tag(name, code, elsewhere) != build_tag(name, code, tools)
    assert build_tag(name, code, [*tools[:-1], "-O2"]) != build_tag(name, code, tools)
    monkeypatch.setenv("CXX", "clang++")  # another compiler: its own build
    assert build_tag(name, code, toolchain([*flags, *LDFLAGS])) != directory.name


def test_the_library_ops_refuse_bad_tensors_with_a_clear_error(built):
    """One check for every op, of every tensor before any is touched: a shape that does not match, mixed
    dtypes, a strided view."""
    w, g, m = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)
    step = lambda w, g, m, shape=(4, 6, 1): built.lmo_step([w], [g], [m], None, list(shape), [-0.1], 2.0, 0.9, False, 1.0)
    partials = lambda g, m, shape=(4, 6, 1): built.lmo_partials([g], [m], None, list(shape), 2.0, 0.9, False)
    bad = [
        (lambda: step(w, g, m, (4, 5, 1)), "moga lmo_step: shape (4, 5, 1) does not match a tensor of 24 elements"),
        (lambda: step(w, g.double(), m), "moga lmo_step: parameter, gradient and buffer dtypes differ"),
        (lambda: step(w, g, m.T.contiguous().T), "moga lmo_step: tensors must be contiguous"),
        (lambda: partials(g, m.half()), "moga lmo_partials: parameter, gradient and buffer dtypes differ"),
        (lambda: partials(g.T, m), "moga lmo_partials: tensors must be contiguous"),
        (lambda: partials(g, m, (2, 6, 1)), "moga lmo_partials: shape (2, 6, 1) does not match"),
        # every tensor is checked before any is stepped (the kernel steps the last one first)
        (lambda: built.lmo_step([w.T, w], [g, g], [m, m], None, [4, 6, 1] * 2, [-0.1] * 2, 2.0, 0.9, False, 1.0),
         "moga lmo_step: tensors must be contiguous"),
        (lambda: built.lmo_apply([w, w], [g, g], [m, m], None, [4, 6, 1, 4, 5, 1], [-0.1] * 2,
                                 [torch.ones(2, 4, 1)] * 2, 2.0, 0.9, False, 1.0), "moga lmo_apply: shape (4, 5, 1)"),
    ]
    before = [t.clone() for t in (w, g, m)]
    for call, message in bad:
        with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            call()
    assert all(torch.equal(a, b) for a, b in zip(before, (w, g, m)))  # refused before touching anything


def test_remembered_plans_are_each_geometry_layouts_and_shapes_own():
    """``plan`` remembers its answers (the step asks for every tensor at every step): each is still the one
    for its geometry, layout (a shard's global shape included) and shape, whatever was asked before."""
    from moga.geometry import KernelPlan
    from moga.layout import Layout, ShardLayout

    geometries = [parse_geometry(s) for s in (*SPECS, "row(p=inf)", "spectral")]
    layouts = [Layout("oi"), Layout("io"), ShardLayout("oi", (16, 6)), ShardLayout("oi", (32, 6))]
    shapes = [torch.Size(s) for s in ((8, 6), (6, 8), (0, 6))]
    for _ in range(2):  # the second round reads what the first remembered
        for g in geometries:
            for layout in layouts:
                for shape in shapes:
                    expected = g.kernel_plan(shape, layout) if shape.numel() else KernelPlan((0, 0, 0), 1.0, 0.0)
                    assert plan(g, layout, shape) == expected, (g, layout, shape)
