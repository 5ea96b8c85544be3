"""The joint (width x depth) verdict carries the same seed intervals as one axis."""

from moga.sweep.report.joint import analyze_joint

from .synthetic import parabola_sweep, pow2


def joint_rows(optima, seeds):
    rows = []
    for depth, opts in zip((2, 4), optima):
        for r in parabola_sweep(opts, scales=(64, 128), lrs=pow2(-8, 0), seeds=seeds, scale_key="width"):
            rows.append({**r, "depth": depth})
    return rows


def test_joint_decision_with_seeds_and_one_seed_is_inconclusive():
    (held,) = analyze_joint(joint_rows([[-4, -4], [-4, -4]], (0, 1, 2)), ["width", "depth"])
    assert held.verdict == "transfers" and held.decision is not None
    assert [s.seeds for s in held.decision.scales] == [3, 3, 3, 3]
    (moved,) = analyze_joint(joint_rows([[-4, -5], [-6, -7]], (0, 1, 2)), ["width", "depth"])
    assert moved.verdict == "does not transfer" and "width 128 depth 4" in moved.verdict_line
    (anecdote,) = analyze_joint(joint_rows([[-4, -4], [-4, -4]], (0,)), ["width", "depth"])
    assert anecdote.verdict == "inconclusive" and "one seed" in anecdote.verdict_line
    assert anecdote.to_dict()["decision"]["verdict"] == "inconclusive"
