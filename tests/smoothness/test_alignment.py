"""Row normalization against orthogonalization on one matrix (moga.smoothness.alignment)."""

import math

import pytest
import torch

from moga.geometry import parse_geometry
from moga.models import GPT
from moga.optim import MOGA
from moga.smoothness.alignment import hidden_alignment, row_polar_alignment


def test_orthogonal_rows_make_the_two_directions_one():
    """M = D Q, Q with orthonormal rows: row normalization and the polar factor both give Q."""
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(48, 16, dtype=torch.float64))  # 16 orthonormal columns of length 48
    m = torch.diag(torch.linspace(0.1, 5.0, 16, dtype=torch.float64)) @ q.T  # 16 x 48, rows orthogonal
    a = row_polar_alignment(m)
    assert a["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert a["gram_coherence"] == pytest.approx(0.0, abs=1e-12)
    assert a["gram_dominance"] > 1e10  # no off-diagonal mass at all
    # and the LMOs of the two geometries point the same way (their scale factors aside)
    row, spectral = parse_geometry("row(p=2)").lmo(m.float()), parse_geometry("spectral(method=svd)").lmo(m.float())
    cos = (row * spectral).sum() / (row.norm() * spectral.norm())
    assert cos.item() == pytest.approx(1.0, abs=1e-5)


def test_gaussian_rows_follow_their_expected_scalings():
    """i.i.d. N(0, 1) entries, m x n: off-diagonal Gram entries ~ N(0, n), so the row cosines have RMS
    1/sqrt(n) and Gershgorin's ratio is n / ((m - 1) sqrt(2 n / pi))."""
    torch.manual_seed(1)
    m, n = 64, 1024
    a = row_polar_alignment(torch.randn(m, n))
    assert a["gram_coherence"] == pytest.approx(1 / math.sqrt(n), rel=0.05)
    assert a["gram_dominance"] == pytest.approx(n / ((m - 1) * math.sqrt(2 * n / math.pi)), rel=0.05)
    assert 0.95 < a["cosine"] < 1  # nearly orthogonal rows: nearly the same direction


def test_correlated_rows_pull_the_directions_apart_and_scale_changes_nothing():
    torch.manual_seed(2)
    shared = torch.randn(1, 256)
    m = shared + 0.3 * torch.randn(32, 256)  # every row mostly the same vector: a near rank-one momentum
    a = row_polar_alignment(m)
    assert a["gram_coherence"] > 0.8 and a["cosine"] < 0.5
    assert row_polar_alignment(7.0 * m) == pytest.approx(a, rel=1e-9)
    # a rank-one a b^T: row normalization gives sign(a_i) b/|b|, the polar factor on its range (a/|a|)(b/|b|)^T,
    # so the cosine is ||a||_1 / (sqrt(m) ||a||_2): rows of equal norm or not, that is the whole difference
    a_, b_ = torch.randn(8, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    one = row_polar_alignment(torch.outer(a_, b_))
    assert one["cosine"] == pytest.approx((a_.abs().sum() / (math.sqrt(8) * a_.norm())).item(), rel=1e-9)
    assert one["gram_coherence"] == pytest.approx(1.0, rel=1e-9)
    zero_row = torch.cat([m, torch.zeros(1, 256)])
    assert row_polar_alignment(zero_row) == pytest.approx(a, rel=1e-9)  # a zero row has no direction
    with pytest.raises(ValueError, match="one matrix"):
        row_polar_alignment(torch.randn(2, 3, 4))


def test_hidden_alignment_reads_every_hidden_momentum_and_nothing_else():
    torch.manual_seed(3)
    model = GPT(vocab_size=17, block_size=8, n_layer=2, n_embd=16, n_head=2)
    opt = MOGA(model, lr=0.01)
    before = hidden_alignment(opt)  # no step yet: no momentum
    assert before["matrices"] == 0 and before["layers"] == [] and math.isnan(before["cosine"])
    x = torch.randint(0, 17, (4, 8))
    model(x)[0].logsumexp(-1).mean().backward()
    opt.step()
    found = hidden_alignment(opt)
    hidden = [p for g in opt.param_groups if g["role"] == "hidden" for p in g["params"]]
    assert found["matrices"] == len(hidden) == 8
    assert [r["shape"] for r in found["layers"]] == [list(p.shape) for p in hidden]
    buf = opt.state[hidden[0]]["momentum_buffer"]
    assert found["layers"][0]["cosine"] == pytest.approx(row_polar_alignment(buf)["cosine"])
    assert found["cosine"] == pytest.approx(sum(r["cosine"] for r in found["layers"]) / 8)
