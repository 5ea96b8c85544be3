"""Every geometry against its definition in docs/math.md §2: optimality and duality of the LMO, the
mean-normalized operator norm it claims to be, orientation, scale invariance and zero handling."""

import math
import threading

import pytest
import torch

from moga.geometry import (
    INF, Col, Embedding, Row, RowSpectral, Sign, Spectral, SpectralRow, Vector, dual_exponent, parse_geometry,
    spec_fields,
)
from moga.layout import Layout


pytestmark = pytest.mark.usefixtures("float64_by_default")


GEOMETRIES = [
    *(Row(p) for p in (1, 1.5, 2, 2.5, 4, INF)),
    *(Col(q) for q in (1, 1.5, 2, 2.5, INF)),
    Sign(),
    Spectral(method="svd"),
    *(Embedding(q) for q in (1, 2, 3, INF)),
    Vector(),
]
# (stored shape, layout): a Linear, an Embedding stored (vocab, d), a Conv2d kernel, a stack of matrices.
CASES = [((5, 7), "oi"), ((9, 4), "io"), ((4, 3, 2, 2), "oiii"), ((3, 4, 6), "boi")]


def ids(g):
    return str(g)


def random_directions(shape, count, gen):
    """Gaussian, sparse and sign-pattern directions: feasible points of every unit ball after scaling."""
    out = []
    for k in range(count):
        d = torch.randn(shape, generator=gen)
        if k % 3 == 1:
            d = d * (torch.rand(shape, generator=gen) < 0.2)
        elif k % 3 == 2:
            d = torch.sign(d)
        out.append(d)
    return out


@pytest.mark.parametrize("geom", GEOMETRIES, ids=ids)
@pytest.mark.parametrize("shape,layout", CASES)
def test_lmo_is_unit_optimal_and_dual(geom, shape, layout):
    gen = torch.Generator().manual_seed(hash((str(geom), shape)) % 2**31)
    g = torch.randn(shape, generator=gen)
    d_star = geom.lmo(g, layout)
    assert d_star.shape == g.shape
    assert geom.norm(d_star, layout).item() == pytest.approx(1.0, rel=1e-9)
    best = torch.sum(g * d_star).item()
    assert best == pytest.approx(-geom.dual_norm(g, layout).item(), rel=1e-9)
    # No other unit-norm direction does better: random ones, and small perturbations of D* itself.
    for d in random_directions(shape, 60, gen):
        n = geom.norm(d, layout)
        if n > 0:
            assert torch.sum(g * d / n).item() >= best - 1e-9
    for _ in range(30):
        d = d_star + 1e-3 * torch.randn(shape, generator=gen)
        assert torch.sum(g * d / geom.norm(d, layout)).item() >= best - 1e-9


@pytest.mark.parametrize("geom", GEOMETRIES, ids=ids)
def test_lmo_is_scale_invariant(geom):
    g = torch.randn(6, 5)
    for c in (1e-4, 3.7, 1e5):
        torch.testing.assert_close(geom.lmo(c * g), geom.lmo(g))


@pytest.mark.parametrize("geom", GEOMETRIES, ids=ids)
@pytest.mark.parametrize("shape,layout", CASES)
def test_zero_rows_columns_and_matrices_give_zero_not_nan(geom, shape, layout):
    zero = torch.zeros(shape)
    assert torch.equal(geom.lmo(zero, layout), zero)
    g = torch.randn(shape)
    lay = Layout(layout)
    g.select(lay.out_dims[0], 0).zero_()  # one row of the logical matrix
    g.select(lay.in_dims[-1], 1).zero_()  # one column
    d = geom.lmo(g, layout)
    assert torch.isfinite(d).all()
    assert geom.norm(d, layout).item() == pytest.approx(1.0)
    if isinstance(geom, (Row, Col, Sign, Vector)):  # local geometries leave zero entries untouched
        assert torch.all(d[g == 0] == 0)


def test_float32_extreme_magnitudes_stay_finite():
    for geom in (Row(1.5), Row(2), Row(2.5), Col(2), Col(3), Embedding(1.5), Embedding(2)):
        for scale in (1e-30, 1e30):
            g = torch.randn(8, 16, dtype=torch.float32) * scale
            d = geom.lmo(g)
            assert torch.isfinite(d).all()
            assert geom.norm(d.double()).item() == pytest.approx(1.0, rel=1e-4)


# --- the norms are docs/math.md §1.2's mean-normalized operator norms --------------------------------------


def mean_norm(x, p):
    """||x||_(p,mean) over the last axis; p = 'l1' is the plain l1 norm of the embedding row."""
    if p == "l1":
        return x.abs().sum(-1)
    if p == INF:
        return x.abs().amax(-1)
    return x.abs().pow(p).mean(-1).pow(1 / p)


def operator_pair(geom):
    """(input norm, output norm) whose induced operator norm the geometry claims to be."""
    if isinstance(geom, Embedding):
        return "l1", geom.q
    if isinstance(geom, Row):
        return geom.p, INF
    if isinstance(geom, Col):
        return 1, geom.q
    if isinstance(geom, Sign):
        return 1, INF
    if isinstance(geom, Spectral):
        return 2, 2
    raise AssertionError(geom)


def maximizer(geom, d):
    """An input x that attains the operator norm (from the closed forms in docs/math.md §2)."""
    from moga.geometry import dual_exponent, phi

    if isinstance(geom, Row):  # the row with the largest l_{p*} norm, paired with its l_p dual vector
        q = dual_exponent(geom.p)
        r = torch.linalg.vector_norm(d, ord=q, dim=1).argmax()
        return phi(d[r], q, (0,))
    if isinstance(geom, (Col, Sign, Embedding)):  # a one-hot input on the largest column
        q = INF if isinstance(geom, Sign) else geom.q
        c = torch.linalg.vector_norm(d, ord=q, dim=0).argmax()
        return torch.nn.functional.one_hot(c, d.shape[1]).to(d.dtype)
    u, s, vh = torch.linalg.svd(d)
    return vh[0]


@pytest.mark.parametrize("geom", [g for g in GEOMETRIES if g.matrix], ids=ids)
@pytest.mark.parametrize("m,n", [(3, 8), (8, 3), (6, 6)])
def test_norm_is_the_mean_normalized_operator_norm(geom, m, n):
    p_in, q_out = operator_pair(geom)
    d = torch.randn(m, n)
    claimed = geom.norm(d).item()
    x = torch.randn(4000, n) * (torch.rand(4000, n) < 0.5)
    x = x[mean_norm(x, p_in) > 0]
    ratios = mean_norm(x @ d.T, q_out) / mean_norm(x, p_in)
    assert ratios.max().item() <= claimed * (1 + 1e-9)
    x_star = maximizer(geom, d)
    attained = (mean_norm(d @ x_star, q_out) / mean_norm(x_star, p_in)).item()
    assert attained == pytest.approx(claimed, rel=1e-9)


# --- orientation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("geom", GEOMETRIES, ids=ids)
def test_embedding_layout_is_the_transpose(geom):
    w = torch.randn(11, 4)  # (vocab, d)
    torch.testing.assert_close(geom.lmo(w, "io"), geom.lmo(w.T.contiguous(), "oi").T)
    torch.testing.assert_close(geom.norm(w, "io"), geom.norm(w.T.contiguous(), "oi"))
    torch.testing.assert_close(geom.dual_norm(w, "io"), geom.dual_norm(w.T.contiguous(), "oi"))


@pytest.mark.parametrize("geom", GEOMETRIES, ids=ids)
def test_conv_kernel_is_out_by_in_times_kernel(geom):
    w = torch.randn(4, 3, 3, 2)
    flat = w.reshape(4, -1)
    torch.testing.assert_close(geom.lmo(w, "oiii"), geom.lmo(flat, "oi").reshape(w.shape))
    torch.testing.assert_close(geom.dual_norm(w, "oiii"), geom.dual_norm(flat, "oi"))


@pytest.mark.parametrize("geom", GEOMETRIES, ids=ids)
def test_stacks_are_independent_matrices_in_the_block_norm(geom):
    w = torch.randn(3, 5, 4)
    per = [w[k] for k in range(3)]
    torch.testing.assert_close(geom.lmo(w, "boi"), torch.stack([geom.lmo(x) for x in per]))
    torch.testing.assert_close(geom.norm(w, "boi"), torch.stack([geom.norm(x) for x in per]).max())
    torch.testing.assert_close(geom.dual_norm(w, "boi"), torch.stack([geom.dual_norm(x) for x in per]).sum())


def test_orientation_errors_say_what_to_pass():
    with pytest.raises(ValueError, match="layout="):
        Row(2).lmo(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="3 axes"):
        Row(2).lmo(torch.randn(2, 3), "boi")
    with pytest.raises(ValueError, match="letters"):
        Layout("ox")


# --- special cases named in docs/math.md §2.8 ----------------------------------------------------------------


def test_sign_is_row1_and_col_inf():
    g = torch.randn(5, 9)
    torch.testing.assert_close(Sign().lmo(g), Row(1).lmo(g))
    torch.testing.assert_close(Sign().lmo(g), Col(INF).lmo(g))
    torch.testing.assert_close(Sign().lmo(g), -torch.sign(g) / 9)


def test_closed_forms():
    g = torch.randn(6, 10)
    m, n = g.shape
    torch.testing.assert_close(Row(2).lmo(g), -g / g.norm(dim=1, keepdim=True) / math.sqrt(n))
    torch.testing.assert_close(Col(2).lmo(g), -g / g.norm(dim=0, keepdim=True) * math.sqrt(m) / n)
    torch.testing.assert_close(Embedding(2).lmo(g), -g / g.norm(dim=0, keepdim=True) * math.sqrt(m))
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    torch.testing.assert_close(Spectral(method="svd").lmo(g), -math.sqrt(m / n) * u @ vh)
    torch.testing.assert_close(Spectral(method="svd", scale="torch").lmo(g), -1.0 * u @ vh)
    torch.testing.assert_close(Spectral(method="svd").dual_norm(g), math.sqrt(m / n) * s.sum())


def test_sign_scale_marks_the_sign_geometries():
    shape = (4, 8)
    assert Sign().sign_scale(shape) == pytest.approx(1 / 8)
    assert Row(1).sign_scale(shape) == pytest.approx(1 / 8)
    assert Col(INF).sign_scale(shape) == pytest.approx(1 / 8)
    assert Embedding(INF).sign_scale((8, 4), "io") == 1.0
    assert Vector().sign_scale((7,)) == 1.0
    assert Row(2).sign_scale(shape) is None and Spectral().sign_scale(shape) is None


# --- specs and bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("geom", GEOMETRIES + [Spectral(steps=7, dtype="float64")], ids=ids)
def test_spec_round_trip(geom):
    assert parse_geometry(str(geom)) == geom


@pytest.mark.parametrize(
    "spec,match",
    [
        ("row(p=0.5)", ">= 1"),
        ("col(q=nan)", ">= 1"),
        ("row(p=-2)", ">= 1"),
        ("embedding(q=0)", ">= 1"),
        ("rows(2)", "unknown geometry"),
        ("row(r=2)", "row takes: p"),
        ("spectral(method=qr)", "newton_schulz"),
        ("spectral(steps=0)", "positive integer"),
        ("row(2", "cannot parse"),
    ],
)
def test_bad_specs_are_clear_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_geometry(spec)


@pytest.mark.parametrize("spec,named", [("spectral", set()), ("spectral(scale=torch)", {"scale"}),
                                        ("spectral( scale = torch , dtype=float32)", {"scale", "dtype"}),
                                        ("spectral(svd, 7)", {"method", "steps"}), ("row(1.5)", {"p"})])
def test_spec_fields_are_the_ones_a_spec_sets(spec, named):
    assert spec_fields(spec) == named


def test_newton_schulz_handles_tiny_and_huge_gradients():
    for scale in (1e-30, 1e30):
        g = torch.randn(8, 16, dtype=torch.float32) * scale
        d = Spectral().lmo(g)
        assert torch.isfinite(d).all()
        assert Spectral(method="svd").norm(d.double()).item() == pytest.approx(1.0, abs=0.3)


@pytest.mark.parametrize("geom", GEOMETRIES, ids=ids)
@pytest.mark.parametrize("shape,layout", CASES)
def test_fused_apply_equals_the_reference_lmo(geom, shape, layout):
    g = torch.randn(shape)
    g.select(Layout(layout).out_dims[0], 1).zero_()
    w = torch.randn(shape)
    fused = w.clone()
    geom.apply_lmo_(fused, g, 0.3, layout)
    torch.testing.assert_close(fused, w + 0.3 * geom.lmo(g, layout))


# --- every magnitude, zero-size tensors, sharded reductions ---------------------------------------------


def magnitudes(dtype):
    """From the smallest subnormal to the largest float, in steps of 2^8 of the exponent, with both ends."""
    info = torch.finfo(dtype)
    smallest = info.smallest_normal * info.eps  # the smallest subnormal: 2^-mantissa_bits of the smallest normal
    low, high = math.log2(smallest), math.log2(info.max)
    return [smallest, *(2.0**e for e in range(math.ceil(low) + 1, int(high), 8)), info.max]


def sign_pattern(shape, value, dtype):
    """+-value with a fixed sign pattern, and a second magnitude a quarter lower: finite at any value."""
    signs = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0]).repeat(math.prod(shape))[: math.prod(shape)]
    scale = torch.where(torch.arange(math.prod(shape)) % 3 == 0, 0.75, 1.0)
    return (signs * scale).reshape(shape).to(torch.float64).mul(value).to(dtype)


EXTREME_GEOMETRIES = [*(Row(p) for p in (1, 1.5, 2, 2.5, 3, INF)), Col(1.5), Col(2), Col(3), Embedding(2),
                      Embedding(3), Sign(), Vector()]


@pytest.mark.parametrize("geom", EXTREME_GEOMETRIES, ids=ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_lmo_is_exact_at_every_magnitude(geom, dtype):
    """The reference LMO at any representable magnitude equals the LMO of the same numbers brought near 1
    by an exact power-of-two scaling (the LMO is scale invariant)."""
    for value in magnitudes(dtype):
        g = sign_pattern((4, 7), value, dtype)
        half = 2.0 ** (-round(math.log2(value)) / 2)
        expected = geom.lmo(g.double() * half * half, "oi")
        torch.testing.assert_close(geom.lmo(g, "oi").double(), expected, rtol=1e-5, atol=0, msg=f"magnitude {value:g}")


@pytest.mark.parametrize("geom", EXTREME_GEOMETRIES, ids=ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fused_step_is_unit_or_zero_at_every_magnitude(geom, dtype):
    """The optimizer's fused step: finite, and the LMO (unit norm) or, for the l2 step outside the range
    where its squares are exact, zero. The issue's case: a float32 row of 1e-44s with p = 1.5 gave NaN."""
    for value in [1e-44, *magnitudes(dtype)] if dtype == torch.float32 else magnitudes(dtype):
        g = sign_pattern((4, 7), value, dtype)
        w = torch.zeros(4, 7, dtype=dtype)
        geom.apply_lmo_(w, g, 1.0, "oi")
        assert torch.isfinite(w).all(), f"magnitude {value:g}"
        if torch.count_nonzero(w):
            torch.testing.assert_close(w.double(), geom.lmo(g, "oi").double(), rtol=1e-5, atol=0)
        else:
            assert geom.p == 2 if isinstance(geom, Row) else geom.q == 2, f"zero step at magnitude {value:g}"


@pytest.mark.parametrize("geom", GEOMETRIES + [Spectral()], ids=ids)
def test_zero_size_tensors_step_as_no_ops(geom):
    empty = torch.zeros(0, 5)
    assert geom.lmo(empty).shape == (0, 5)
    assert geom.norm(empty).item() == 0 and geom.dual_norm(empty).item() == 0
    geom.apply_lmo_(empty, empty, 0.1)


def run_sharded(geom, g, layout, dim, method, *args):
    """Two threads stand for two ranks, each holding half of ``g`` along ``dim``; ``reduce`` combines each
    per-row or per-column partial result across them, as an all-reduce would."""
    shards = list(torch.tensor_split(g, 2, dim=dim))
    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def reduce(partial, op):
        rank = reduce.rank.value
        slots[rank] = partial
        barrier.wait()
        combined = torch.stack(slots).sum(0) if op == "sum" else torch.stack(slots).amax(0)
        barrier.wait()
        return combined

    reduce.rank = threading.local()

    def work(rank):
        reduce.rank.value = rank
        if method == "apply_lmo_":
            w = torch.zeros_like(shards[rank])
            geom.apply_lmo_(w, shards[rank], *args, layout=layout, reduce=reduce, shape=g.shape)
            results[rank] = w
        else:
            results[rank] = getattr(geom, method)(shards[rank], layout, reduce, g.shape)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("geom", [Row(1.5), Row(2), Row(3), Row(INF), Col(2), Col(1.5), Embedding(3)], ids=ids)
@pytest.mark.parametrize("shape,layout", [((6, 8), "oi"), ((8, 6), "io"), ((2, 6, 8), "boi")])
def test_sharded_reduced_axis_with_reduce_equals_the_whole(geom, shape, layout):
    g = torch.randn(shape)
    reduced = geom.reduced_dims(layout)
    assert reduced == (Layout(layout).in_dims if isinstance(geom, Row) else Layout(layout).out_dims)
    dim = reduced[0]
    for method in ("lmo", "apply_lmo_"):
        parts = run_sharded(geom, g, layout, dim, method, *((0.5,) if method == "apply_lmo_" else ()))
        whole = geom.lmo(g, layout) * (0.5 if method == "apply_lmo_" else 1)
        torch.testing.assert_close(torch.cat(parts, dim), whole)
    # norms: the per-row (per-column) values are combined; each rank holds every row, so each gets the whole
    for method in ("norm", "dual_norm"):
        for part in run_sharded(geom, g, layout, dim, method):
            torch.testing.assert_close(part, getattr(geom, method)(g, layout))


def test_reduced_dims_name_what_needs_communication():
    assert Row(2).reduced_dims("oi") == (1,) and Row(2).reduced_dims("io") == (0,)
    assert Col(2).reduced_dims("oiii") == (0,) and Embedding(2).reduced_dims("io") == (1,)
    assert Sign().reduced_dims("oi") == () and Vector().reduced_dims() == ()
    assert Spectral().reduced_dims("boi") == (1, 2)
    with pytest.raises(ValueError, match="whole matrices"):
        Spectral().lmo(torch.randn(4, 4), reduce=lambda t, op: t)


@pytest.mark.parametrize("geom", GEOMETRIES, ids=ids)
@pytest.mark.parametrize("shape, layout", CASES + [((6, 3, 5), "ioi"), ((5, 7), "io")])
def test_kernel_plan_is_the_lmo_along_its_view(geom, shape, layout):
    """Where a geometry gives the fused kernel's form, ``-factor * phi_p`` along K of the (B, K, N) view is
    its LMO; it gives none only where the kernel cannot take it (p = inf, axes that are not adjacent)."""
    lay = Layout(layout)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    planned = geom.kernel_plan(shape, lay)
    assert geom.has_kernel_form == isinstance(geom, (Row, Col, Sign))
    if not geom.has_kernel_form:
        assert planned is None
        return
    p = 1.0 if isinstance(geom, Sign) else geom.p if isinstance(geom, Row) else dual_exponent(geom.q)
    dims = lay.in_dims if isinstance(geom, Row) else lay.out_dims
    if p == INF or (p != 1 and list(dims) != list(range(dims[0], dims[-1] + 1))):
        assert planned is None
        return
    (b, k, n), p_kernel, factor = planned
    assert p_kernel == p and b * k * n == g.numel()
    view = g.reshape(b, k, n)
    phi = torch.sign(view) if p == 1 else view.sign() * view.abs() ** (p - 1) / torch.linalg.vector_norm(
        view, ord=p, dim=1, keepdim=True) ** (p - 1)
    torch.testing.assert_close((-factor * phi).reshape(shape), geom.lmo(g, lay))


# --- the row-family hybrids of normalization and orthogonalization (docs/math.md §2.9) ---------------------------

HYBRID_SHAPES = [(3, 8), (8, 3), (6, 6)]


def exact_polar(mat):
    """U V^T from torch's SVD, written out here as the reference (full rank: the tests' matrices are)."""
    u, _, vh = torch.linalg.svd(mat, full_matrices=False)
    return u @ vh


def uneven_rows(m, n, seed):
    """A Gaussian matrix whose rows differ in size by six orders of magnitude, as a momentum's rows can."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, n, generator=gen) * torch.logspace(-3, 3, m).unsqueeze(1)


@pytest.mark.parametrize("m,n", HYBRID_SHAPES)
def test_row_spectral_is_the_spectral_lmo_of_the_row_normalized_direction(m, n):
    g = uneven_rows(m, n, m * n)
    d = RowSpectral(method="svd").lmo(g)
    rows = g / g.norm(dim=1, keepdim=True)
    torch.testing.assert_close(d, -math.sqrt(m / n) * exact_polar(rows), rtol=0, atol=1e-12)
    spectral = Spectral(method="svd")
    assert spectral.norm(d).item() == pytest.approx(1.0, abs=1e-12)  # unit norm in Muon's geometry
    assert (g * d).sum().item() >= -spectral.dual_norm(g).item() * (1 + 1e-12)  # no better than Muon's own LMO
    assert (d - spectral.lmo(g)).abs().max().item() > 1e-2  # and not Muon's step: the small rows count now


@pytest.mark.parametrize("m,n", HYBRID_SHAPES)
def test_spectral_row_gives_every_row_the_same_norm_and_keeps_muons_frobenius_norm(m, n):
    g = uneven_rows(m, n, m + n)
    d = SpectralRow(method="svd").lmo(g)
    polar = exact_polar(g)
    equal = polar / (polar.norm(dim=1, keepdim=True) + 1e-10)  # NorMuon's eps, which matters for tiny rows
    torch.testing.assert_close(d, -math.sqrt(m / n) * polar.norm() * equal / (equal.norm() + 1e-10), rtol=0,
                               atol=1e-12)
    slack = 1e-10 / polar.norm(dim=1).min().item() + 1e-12  # the eps's share of the smallest row
    torch.testing.assert_close(d.norm(dim=1), torch.full((m,), d.norm(dim=1).max().item()), rtol=slack, atol=0)
    # the update's Frobenius norm, so its RMS, is Muon's at every shape: sqrt(m/n) sqrt(min(m, n))
    assert d.norm().item() == pytest.approx(math.sqrt(m / n) * math.sqrt(min(m, n)), rel=slack)
    if m <= n:  # a wide polar factor's rows are orthonormal: nothing to equalize, Muon's step exactly
        torch.testing.assert_close(d, Spectral(method="svd").lmo(g), rtol=0, atol=1e-9)


@pytest.mark.parametrize("geom", [RowSpectral(method="svd"), SpectralRow(method="svd"),
                                  SpectralRow(beta2=0.9, method="svd")], ids=ids)
@pytest.mark.parametrize("shape,layout", CASES)
def test_hybrids_step_each_logical_matrix_as_a_plain_matrix(geom, shape, layout):
    """Orientation and batch axes: an embedding stored (vocab, d), a conv kernel and a stack of matrices step as
    the matrices they hold; apply_lmo_ is lmo."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(shape, generator=gen)
    lay = Layout(layout)
    mats = lay.to_matrix(g)
    expected = lay.from_matrix(torch.stack([geom.lmo(mat) for mat in mats]), shape)
    torch.testing.assert_close(geom.lmo(g, layout), expected, rtol=0, atol=1e-12)
    w = torch.randn(shape, generator=gen)
    stepped = w.clone()
    geom.apply_lmo_(stepped, g, 0.25, layout)
    torch.testing.assert_close(stepped, w + 0.25 * expected, rtol=0, atol=1e-12)


def test_normuon_second_moment_is_neuron_wise_adam_on_the_polar_factor():
    """spectral_row(beta2) against NorMuon's update written out plainly (arXiv 2510.05491; its reference code
    divides each row of the orthogonalized update by the root of an EMA of the row's mean square, then restores
    the Frobenius norm the update had): three steps carry the moment, which apply_lmo_ updates in place."""
    geom = SpectralRow(beta2=0.9, method="svd")
    m, n = 5, 7
    gen = torch.Generator().manual_seed(3)
    moment = torch.zeros(1, m)
    v = torch.zeros(m)
    w = torch.zeros(m, n)
    expected = torch.zeros(m, n)
    for _ in range(3):
        g = uneven_rows(m, n, int(torch.randint(0, 1000, (1,), generator=gen)))
        geom.apply_lmo_(w, g, 0.5, moment=moment)
        o = exact_polar(g)
        v = 0.9 * v + 0.1 * o.square().mean(dim=1)
        scaled = o / (v.sqrt().unsqueeze(1) + 1e-10)
        expected -= 0.5 * math.sqrt(m / n) * o.norm() * scaled / scaled.norm()
        torch.testing.assert_close(moment[0], v, rtol=1e-12, atol=0)
        torch.testing.assert_close(w, expected, rtol=0, atol=1e-9)
    assert not torch.allclose(w, -1.5 * SpectralRow(method="svd").lmo(g))  # the moment's history mattered


def test_hybrid_specs_round_trip_and_only_normuons_moment_is_state():
    for spec in ("row_spectral", "spectral_row", "spectral_row(beta2=0.95)", "row_spectral(method=svd)"):
        assert str(parse_geometry(spec)) == spec
    assert parse_geometry("spectral_row(beta2=0.95)").state_shape((4, 3, 6), "boi") == (4, 3)
    assert parse_geometry("spectral_row").state_shape((4, 6), "oi") is None
    assert not parse_geometry("row_spectral").stateful
    with pytest.raises(ValueError, match="beta2"):
        parse_geometry("spectral_row(beta2=1)")
