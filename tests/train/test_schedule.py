"""get_lr(it): warmup then cosine to a floor (the papers' two variants), constant, warmup then constant."""

import math

import pytest

from moga.train.config import ScheduleConfig
from moga.train.schedule import Schedule, build_schedule


def factors(s: Schedule) -> list[float]:
    return [s.factor(it) for it in range(s.total)]


def test_gpt_variant_ten_percent_warmup_floor_point_one():
    s = build_schedule(ScheduleConfig(name="cosine", warmup_fraction=0.1, min_lr_ratio=0.1), 1200, None)
    assert s.warmup == 120
    f = factors(s)
    assert f[0] == pytest.approx(1 / 121)  # nanoGPT: (it + 1) / (warmup + 1), never 0
    assert all(b > a for a, b in zip(f[:120], f[1:120]))  # linear rise
    assert f[119] == pytest.approx(120 / 121)
    assert f[120] == 1.0  # the peak right after warmup
    assert all(b <= a for a, b in zip(f[120:], f[121:]))  # then only down
    assert f[-1] == pytest.approx(0.1)  # the floor is reached at the last step
    assert f[120 + 1079 // 2] == pytest.approx(0.55, abs=2e-3)  # halfway down: the middle of [0.1, 1]
    assert min(f[120:]) >= 0.1 - 1e-12
    assert s.get_lr(1199, 4e-3) == pytest.approx(4e-4)


def test_resnet_variant_one_epoch_warmup_floor_one_half():
    steps_per_epoch = 703  # 45k images, batch 64
    s = build_schedule(ScheduleConfig(name="cosine", warmup_epochs=1, min_lr_ratio=0.5), 20 * steps_per_epoch,
                       steps_per_epoch)
    assert s.warmup == steps_per_epoch
    f = factors(s)
    assert f[steps_per_epoch] == 1.0
    assert f[-1] == pytest.approx(0.5)
    assert min(f[steps_per_epoch:]) == pytest.approx(0.5)


def test_constant_and_warmup_constant():
    assert factors(build_schedule(ScheduleConfig(name="constant"), 50, None)) == [1.0] * 50
    f = factors(build_schedule(ScheduleConfig(name="warmup_constant", warmup_steps=4), 10, None))
    assert f == pytest.approx([0.2, 0.4, 0.6, 0.8] + [1.0] * 6)


def test_cosine_without_warmup_starts_at_the_peak():
    f = factors(Schedule("cosine", 11, 0, 0.0))
    assert f[0] == 1.0 and f[-1] == pytest.approx(0.0, abs=1e-12)
    assert f[5] == pytest.approx(0.5)
    assert f == pytest.approx([0.5 * (1 + math.cos(math.pi * i / 10)) for i in range(11)])


def test_degenerate_lengths():
    assert factors(Schedule("cosine", 1, 0, 0.1)) == [1.0]  # a one-step run takes the peak
    assert factors(Schedule("cosine", 3, 3, 0.1)) == pytest.approx([0.25, 0.5, 0.75])
    with pytest.raises(ValueError, match="warmup"):
        build_schedule(ScheduleConfig(name="cosine", warmup_steps=20), 10, None)
    with pytest.raises(ValueError, match="epochs"):
        build_schedule(ScheduleConfig(name="cosine", warmup_epochs=1), 10, None)


def test_wsd_holds_the_peak_then_decays_linearly_to_the_floor():
    cfg = ScheduleConfig(name="wsd", warmup_steps=2, decay_fraction=0.4, min_lr_ratio=0.0)
    s = build_schedule(cfg, 10, None)
    assert [s.factor(i) for i in range(10)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0.0])


def test_wsd_budgets_share_the_stable_phase():
    """A short budget's run is the long one's until its own decay starts: branching a cooldown from the long
    run's checkpoint there gives the short run."""
    cfg = ScheduleConfig(name="wsd", warmup_steps=5, decay_fraction=0.2)
    short, long = build_schedule(cfg, 100, None), build_schedule(cfg, 800, None)
    assert all(short.factor(i) == long.factor(i) for i in range(80))
    assert short.factor(99) == pytest.approx(0.1) and long.factor(99) == 1.0


def test_wsd_bad_lengths_are_clear_errors():
    with pytest.raises(ValueError, match="warmup .* and decay .* are longer than the run"):
        build_schedule(ScheduleConfig(name="wsd", warmup_steps=9, decay_fraction=0.5), 10, None)
    with pytest.raises(ValueError, match="decay_fraction applies to schedule 'wsd'"):
        ScheduleConfig(name="cosine", decay_fraction=0.5)
