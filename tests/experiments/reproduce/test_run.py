"""Judging a paper's claim from the panels' verdicts, and two reproductions end to end in miniature."""

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest


from moga.experiments.reproduce.catalog import Reproduction, catalog, get, merge
from moga.experiments.reproduce.quality import _tuned_verdict, claim_outcome, verdict
from moga.experiments.reproduce.stats import relative_interval
from moga.experiments.reproduce.run import judge_panels, recheck, rejudge, reproduce
from moga.experiments.reproduce.table import END, START, load_outcomes, results_table, update_readme
from moga.sweep.report import analyze
from moga.sweep.report.summary import json_safe
from moga.sweep.store import SweepStore

from ...conftest import dataset_or_skip
from ...sweep.report.synthetic import parabola_sweep

EXPECT = [{"panel": {"scaling": "inverse_depth"}, "verdict": "transfers"},
          {"panel": {"scaling": "none"}, "verdict": "does not transfer"}]


def verdicts(rows):
    return [{"panel": p.panel, "title": p.title, "verdict": p.verdict, "line": p.verdict_line}
            for p in analyze(rows, resamples=200)]


def test_a_28_percent_regret_fails_the_claim():
    floors = [0.5, 0.5, 0.5, 0.5, 0.25]  # one grid step of drift, but 28% regret at K=32
    rows = (parabola_sweep([-4, -4, -4, -4, -5], floors=floors, curvature=0.07)
            + parabola_sweep([-3, -4, -5, -6, -7], scaling="none"))
    outcome, lines = judge_panels(EXPECT, verdicts(rows))
    assert outcome == "failed"
    assert lines[0].startswith("[failed] moga, inverse_depth (alpha=K_base/K) (claimed: transfers): does not transfer")
    assert lines[1].startswith("[held]")


def test_held_and_undecided():
    rows = parabola_sweep([-4.2] * 5) + parabola_sweep([-3, -4, -5, -6, -7], scaling="none")
    assert judge_panels(EXPECT, verdicts(rows))[0] == "held"
    edge = parabola_sweep([-4, -4, -4], scales=(2, 4, 8), lrs=[2.0**k for k in range(-4, 0)], floors=[30.0] * 3)
    outcome, lines = judge_panels(EXPECT, verdicts(edge + parabola_sweep([-3, -4, -5, -6, -7], scaling="none")))
    assert outcome == "undecided" and "no verdict" in lines[0]
    assert judge_panels(EXPECT, verdicts(parabola_sweep([-4.2] * 5)))[0] == "undecided"  # no baseline panel ran


def test_one_seed_is_inconclusive_and_a_confident_opposite_fails():
    one_seed = parabola_sweep([-4.2] * 5, seeds=(0,)) + parabola_sweep([-3, -4, -5, -6, -7], scaling="none")
    outcome, lines = judge_panels(EXPECT, verdicts(one_seed))
    assert outcome == "inconclusive" and lines[0].startswith("[inconclusive]") and "one seed" in lines[0]


def test_a_transfer_reproduction_adds_seeds_where_it_decides_and_its_outcome_rechecks(tmp_path):
    rep = mini("depth-mlp", base={"train": {"steps": 12, "batch_size": 32}, "checkpoint": {"every": 6},
                                  "eval": {"final_window": 4}, "model": {"width": 16}},
               axes={"optim.name": ["moga"], "model.depth_scaling": ["inverse_depth"], "model.depth": [1, 2],
                     "optim.lr": {"by": "optim.name", "values": {"moga": {"pow2": [-5, -2]}}}})
    out = reproduce(rep, tmp_path / "mlp", "quick", workers=2, progress=False, min_seeds=3, max_seeds=3)
    cells = out["cells"]
    grid = [c for c in cells if c["seed"] == 0]
    assert len(grid) == 8 and {c["seed"] for c in cells} <= {0, 1, 2}
    (panel,) = out["panels"]
    if panel["decision"] is not None:  # optima inside the grid: 3 seeds at every decisive rate of both depths
        for s in panel["decision"]["scales"]:
            assert s["seeds"] == 3
        assert len(cells) > len(grid)
    # the stored file alone gives the same verdicts, and a second run trains nothing new
    stored = json.loads((tmp_path / "mlp" / "outcome.json").read_text())
    assert stored["report"] == "report/report.md"  # the run's own path: no directory of this machine
    assert [(v["panel"], v["verdict"], v["line"]) for v in recheck(stored)] == \
        [(p["panel"], p["verdict"], p["line"]) for p in stored["panels"]]
    again = reproduce(rep, tmp_path / "mlp", "quick", workers=1, progress=False, min_seeds=3, max_seeds=3)
    assert again["runs"] == out["runs"] and len(again["cells"]) == len(cells)


def mini(name: str, **sweep) -> Reproduction:
    rep = get(name)
    raw = merge(json.loads(json.dumps(rep.raw)), {"scales": {"quick": {"sweep": sweep}}})
    return Reproduction(rep.name, rep.paper, rep.figure, rep.claim, rep.kind, raw)


def test_joint_and_race_end_to_end_and_the_readme_table(tmp_path):
    runs = tmp_path / "runs"
    joint = mini("joint", base={"train": {"steps": 20, "batch_size": 32}, "checkpoint": {"every": 10},
                                "eval": {"final_window": 5}},
                 axes={"model.width": [8, 16], "model.depth": [1, 2], "optim.lr": {"pow2": [-4, -2]}})
    out = reproduce(joint, runs / "quick" / "joint", "quick", workers=2, progress=False)
    assert out["outcome"] in ("held", "failed", "undecided") and out["runs"]["finished"] == 12
    stored = json.loads((runs / "quick" / "joint" / "outcome.json").read_text())
    assert stored["outcome"] == out["outcome"] and "tuning FLOPs saved" in stored["key"]
    again = rejudge(stored, joint.expect)  # the stored cells alone give the same verdict and numbers
    assert [again[k] for k in ("outcome", "key", "details", "panels")] == \
        [stored[k] for k in ("outcome", "key", "details", "panels")]
    (panel,) = json.loads((runs / "quick" / "joint" / "report" / "joint.json").read_text())
    assert len(panel["pairs"]) == 4 and panel["reference"] == [8.0, 1.0]
    assert 0 < panel["tuning_flops_saved"] < 1
    assert (runs / "quick" / "joint" / "report" / "figures" / "regret_map_0.png").is_file()
    # the store is resumable: a second call trains nothing, and the outcome counts the time of both calls
    start = time.time()
    again = reproduce(joint, runs / "quick" / "joint", "quick", workers=1, progress=False)
    took = time.time() - start
    assert again["outcome"] == out["outcome"] and took < out["seconds"]
    assert abs(again["seconds"] - (out["seconds"] + took)) < 1.0

    race = mini("race", base={"logging": {"log_every": 1}, "checkpoint": {"every": 6}, "eval": {"final_window": 4},
                              "schedule": {"warmup_steps": 2}},
                axes={"train.steps": [10, 20], "optim.weight_decay": [0.1],
                      "optim.lr": {"by": "optim.name", "values": {"moga": [0.05], "muon": [0.01]}}})
    shakespeare = dataset_or_skip("tinyshakespeare.txt", "tiny Shakespeare (the race miniature's text)")
    result = reproduce(race, runs / "quick" / "race", "quick", workers=2, progress=False, data=str(shakespeare))
    # one rate each is no tuning: whoever is faster, the race cannot decide the claim
    assert result["outcome"] == "undecided"
    ends = [line for line in result["details"] if "end-of-run loss" in line]
    assert len(ends) == 4 * 2 and all("3 seeds" in line for line in ends)  # four arms, two budgets
    assert any(line.startswith("muon (published) at budget 20 steps") for line in ends)
    stored = json.loads((runs / "quick" / "race" / "report" / "race.json").read_text())
    subjects_in_order = ["moga (default preset)", "moga (paper preset)", "moga (muoneq preset)"]
    subjects = set(subjects_in_order)
    assert set(stored["end_of_run"]) == subjects | {"muon (published)"}
    assert stored["end_of_run"]["moga (paper preset)"]["20"]["weight_decay"] == 0.1
    assert set(stored["ratios"]) == subjects
    # the time ratio is the token ratio times the step-time ratio, timed side by side after the runs
    timing = stored["step_cost"]
    assert list(timing["seconds"]) == [*subjects_in_order, "muon (published)"]
    assert all(len(v) == 3 for v in timing["seconds"].values()) and timing["steps"] == 2
    for subject, by_budget in stored["ratios"].items():
        rival = timing["seconds"]["muon (published)"]
        step = float(np.median([s / r for s, r in zip(timing["seconds"][subject], rival)]))
        for r in by_budget.values():
            assert r["step_ratio"] == pytest.approx(step)
            if r["tokens_ratio"] is not None:  # an open end (inf) is stored as null
                assert r["time_ratio"] == pytest.approx(r["tokens_ratio"] * step)
    assert any(line.startswith("step times, side by side (3 rounds of 2 steps") for line in result["details"])
    # kept, and read again (not timed again) while the arms and the timing settings are the same
    from moga.experiments.reproduce.race import STEP_COST, contender_arms, time_steps, timing_settings

    kept = json.loads((runs / "quick" / "race" / STEP_COST).read_text())
    assert time_steps(contender_arms(race), timing_settings(race, "quick"), race.sweep("quick", str(shakespeare)),
                      runs / "quick" / "race") == kept
    # the same store judged as a research sweep's store is (python -m moga.experiments.reproduce.race judge
    # RUN_DIR --rival ARM): the same best settings and token ratios, its arms in its own order, timed again
    from moga.experiments.reproduce.race import store_race

    mine = json_safe(store_race(runs / "quick" / "race", "muon (published)", {"rounds": 2, "steps": 1})["race"])
    assert list(mine["step_cost"]["seconds"]) == [*sorted(subjects), "muon (published)"]
    assert mine["end_of_run"] == stored["end_of_run"]
    tokens = lambda ratios: {s: {b: r["tokens_ratio"] for b, r in v.items()} for s, v in ratios.items()}  # noqa: E731
    assert tokens(mine["ratios"]) == tokens(stored["ratios"])  # (the intervals resample the timing's rounds too)
    # each 10-step budget is a cooldown branched from its 20-step run at step 8, its own decay start
    cells = SweepStore(runs / "quick" / "race").cells()
    short = [c for c in cells if c["params"]["train.steps"] == 10]
    assert short and all(c["result"]["branched_from"]["step"] == 8 for c in short)

    table = results_table(load_outcomes(runs))
    assert table.count("\n") == 1 + len(catalog())  # header, rule, a row per claim
    assert f"not run at CPU scale here; `--quick`: {out['outcome']}" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Paper claims\n{START}\nSTALE TABLE\n{END}\nrest\n")
    update_readme(readme, runs, tmp_path / "docs" / "reproduce")
    text = readme.read_text()
    assert "STALE TABLE" not in text and "| `moga reproduce joint` |" in text and text.endswith("rest\n")
    assert (tmp_path / "docs" / "reproduce" / "quick" / "joint.json").is_file()
    # the table can be made again from the stored copies alone
    assert results_table(load_outcomes(tmp_path / "docs" / "reproduce")) == table
    with pytest.raises(ValueError, match="no <!-- reproduce:start -->"):
        update_readme(tmp_path / "docs" / "reproduce" / "quick" / "joint.json", runs)


def end_of_run(losses_by_budget, spread=0.01):
    """{budget: three seeds' end-of-run losses} from a seed-mean loss per budget."""
    return {b: [m * (1 + spread * (s - 1)) for s in range(3)] for b, m in losses_by_budget.items()}


def test_race_ratios_at_equal_end_of_run_loss():
    from moga.experiments.reproduce.race import budget_state, race_ratios, token_trend, tokens_to_loss

    budgets = [100, 200, 400, 800]
    rival = end_of_run({b: 3.0 - 0.2 * np.log2(b / 100) for b in budgets})  # loses 0.2 per doubling
    # the subject ends each budget where the rival ends twice that budget: half the tokens, half the time
    subject = end_of_run({b: 3.0 - 0.2 * (np.log2(b / 100) + 1) for b in budgets[:3]})
    assert tokens_to_loss(budgets, [3.0, 2.8, 2.6, 2.4], 2.7) == pytest.approx(200 * 2**0.5)
    # beyond the budgets run, no extrapolation: more than the largest (inf), less than the smallest (0)
    assert tokens_to_loss(budgets, [3.0, 2.8, 2.6, 2.4], 2.3) == math.inf
    assert tokens_to_loss(budgets, [3.0, 2.8, 2.6, 2.4], 3.1) == 0.0
    ratios = race_ratios(subject, rival, [0.8] * 5)  # its step takes 0.8x the rival's
    for b, r in ratios.items():
        assert r["tokens_ratio"] == pytest.approx(0.5) and r["time_ratio"] == pytest.approx(0.4)
        assert r["tokens_interval"][1] < 1 and r["time_interval"][1] < 1 and budget_state(r) == "held"
    # half the tokens, but a step 2.5x as long: behind in time, so failed; the rounds' spread widens the interval
    slow = race_ratios(subject, rival, [2.3, 2.4, 2.5, 2.6, 2.7])[200]
    assert slow["time_ratio"] == pytest.approx(1.25) and slow["time_interval"][0] > 1
    assert budget_state(slow) == "failed"
    steady = race_ratios(subject, rival, [2.5] * 5)[200]
    assert steady["time_interval"][1] - steady["time_interval"][0] < slow["time_interval"][1] - slow["time_interval"][0]
    swapped = race_ratios(rival, subject, [1.25] * 5)
    assert swapped[400]["tokens_ratio"] == pytest.approx(2.0) and budget_state(swapped[400]) == "failed"
    assert swapped[100]["tokens_ratio"] == math.inf and budget_state(swapped[100]) == "failed"
    assert token_trend(ratios) == "no trend across budgets: the token intervals overlap"
    # read over the budgets with a ratio in range: the smallest budget's open end (inf) is not a trend
    rising = {b: {"tokens_ratio": x, "tokens_interval": (x - 0.05, x + 0.05)}
              for b, x in ((100, math.inf), (200, 1.2), (400, 1.3), (800, 1.5))}
    assert token_trend(rising) == "the token ratio rises with budget"
    # equal curves: ratio 1, and the seeds' spread gives an interval around it
    same = race_ratios(rival, rival, [1.0])[200]
    assert same["tokens_ratio"] == pytest.approx(1.0) and same["tokens_interval"][0] < 1 < same["tokens_interval"][1]
    assert budget_state(same) == "inconclusive"


STORED = Path(__file__).parents[3] / "docs" / "reproduce" / "cpu"
VERDICT_FIELDS = ("outcome", "key", "details", "unclaimed", "panels")


def mismatches(outcome: dict) -> list[str]:
    """The fields of a stored outcome that its own numbers, judged again, do not reproduce: a transfer's or joint's
    panels (verdict, line, every drift and regret interval), the claim's outcome, key number and lines; for
    convergence, every check from its per-seed numbers."""
    again = rejudge(outcome, get(outcome["name"]).expect)
    return [k for k in VERDICT_FIELDS if k in outcome and again.get(k) != outcome[k]]


def test_the_stored_cpu_outcomes_recheck_from_their_own_cells():
    """docs/reproduce/cpu: every outcome that stores its cells (or per-seed numbers) gives the same verdicts,
    with the same numbers, when recomputed from them."""
    checked = 0
    for path in sorted(STORED.glob("*.json")):
        outcome = json.loads(path.read_text())
        assert not Path(outcome.get("report", "")).is_absolute(), path.name  # a stored file names no machine's path
        kind = get(outcome["name"]).kind
        if kind == "convergence":
            if "seed_numbers" not in outcome:
                continue  # stored before its depth and ||W|| checks ran on seeds
            numbers = outcome["seed_numbers"]
            assert mismatches(outcome) == [], path.name
            assert all(len(e["adaptive"]) >= 3 for e in numbers["adaptive_vs_constant"]), path.name
            assert all(len(d["losses"]) >= 3 for d in numbers["deeper_slower"].values()), path.name
            assert all(len(d["growth"]) >= 3 for d in numbers["w_growth"].values()), path.name
            checked += 1
            continue
        if "cells" not in outcome:
            continue  # stored before verdicts had intervals: the README table marks it
        if "analysis" not in outcome:  # the quality kind stores each comparison with both sides' seed losses
            for c in (c for c in outcome["cells"] if "relative" in c):
                point, low, high = relative_interval(c["subject_losses"], c["baseline_losses"])
                assert (point, low, high) == pytest.approx((c["relative"], c["low"], c["high"])), path.name
                assert c["seeds"] >= 3 and c["outcome"] == _tuned_verdict(verdict(low, high), c,
                                                                          c["baseline_lr_on_edge"]), path.name
            assert outcome["outcome"] == claim_outcome(outcome["cells"]), path.name
            checked += 1
            continue
        assert mismatches(outcome) == [], path.name  # the claim's outcome, key number and panels' numbers too
        group = outcome["analysis"]["group_keys"] + (["model.depth"] if kind == "joint" else [])
        seeds = {}
        for c in outcome["cells"]:
            seeds.setdefault((tuple(str(c[k]) for k in group), c["scale"], c["lr"]), set()).add(c["seed"])
        assert max(len(s) for s in seeds.values()) >= 3, path.name
        if kind == "joint":  # every settled cell is stored, and every pair's decision has 3+ seeds
            assert len(outcome["cells"]) == sum(outcome["runs"].values()), path.name
            assert all(s["seeds"] >= 3 for p in outcome["panels"] for s in p["decision"]["scales"]), path.name
        checked += 1
    if not checked:
        pytest.skip("no stored CPU outcome keeps its cells yet")


def test_a_changed_stored_number_is_caught_by_the_recheck():
    """The recheck compares numbers, not only verdict words: one cell's loss 1% higher moves the joint panel's
    intervals; the reused rate 20% worse at the largest pair flips the claim; a seed whose ||W|| stopped growing
    moves the convergence check."""
    joint = json.loads((STORED / "joint.json").read_text())
    ref_lr = joint["panels"][0]["reference_lr"]
    nudged = json.loads(json.dumps(joint))
    cell = next(c for c in nudged["cells"]
                if (c["scale"], c["model.depth"], c["lr"], c["seed"]) == (512, 16, ref_lr, 1))
    cell["train_loss"] *= 1.01
    assert mismatches(nudged) == ["panels"]  # the same verdict sentence, other interval numbers
    worse = json.loads(json.dumps(joint))
    for c in worse["cells"]:
        if (c["scale"], c["model.depth"], c["lr"]) == (512, 16, ref_lr):
            c["train_loss"] *= 1.2
    again = rejudge(worse, get("joint").expect)
    assert again["outcome"] == "failed" and again["panels"][0]["verdict"] == "does not transfer"
    assert "outcome" in mismatches(worse)

    numbers = {"w_growth": {"adaptive": {"seeds": [0, 1, 2], "growth": [0.12, 0.15, 0.13],
                                         "rose_last_quarter": [True, True, True]}}}
    outcome = {"name": "convergence", "seed_numbers": numbers}
    outcome.update({k: v for k, v in rejudge(outcome, []).items() if k in VERDICT_FIELDS})
    assert outcome["outcome"] == "held" and mismatches(outcome) == []
    numbers["w_growth"]["adaptive"]["growth"][1] = 0.001
    assert mismatches(outcome) == ["outcome", "key", "details"]


def test_the_convergence_outcome_states_its_seed_interval(tmp_path):
    import torch

    rep = get("convergence")
    raw = merge(json.loads(json.dumps(rep.raw)), {"scales": {"quick": {"settings": {"shared_depths": []}}}})
    rep = Reproduction(rep.name, rep.paper, rep.figure, rep.claim, rep.kind, raw)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's setting: the runs pin their own, so the numbers match on any machine
    try:
        out = reproduce(rep, tmp_path / "c", "quick", progress=False)
        assert torch.get_num_threads() == 2  # given back
    finally:
        torch.set_num_threads(threads)
    assert out["threads"] == 1
    result = json.loads((tmp_path / "c" / "results.json").read_text())
    (entry,) = result["adaptive_vs_constant"]
    gain = entry["gain"]
    assert gain["seeds"] == 3 and len(entry["runs"]) == 3 * 3  # the quick scale's 3 seeds, adaptive + 2 rates each
    assert out["outcome"] == {"held": "held", "failed": "failed", "inconclusive": "inconclusive"}[gain["verdict"]]
    assert "95% interval" in out["key"] and "Student t over 3 paired seeds" in out["key"]
    assert out["details"][0].startswith(f"[{gain['verdict']}] adaptive beats every constant rate on digits")


def test_a_claim_of_several_checks():
    from moga.experiments.reproduce.run import combined_outcome

    assert combined_outcome(["held", "held"]) == "held"
    assert combined_outcome(["held", "inconclusive"]) == "inconclusive"
    assert combined_outcome(["inconclusive", "not measured"]) == "undecided"
    assert combined_outcome(["held", "failed", "not measured"]) == "failed"
    assert combined_outcome([]) == "undecided"
