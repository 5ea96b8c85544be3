"""Seed statistics: the lr of lowest seed mean over the lrs with every seed, and the seed-bootstrap interval."""

import pytest

from moga.experiments.reproduce.stats import best_lr, relative_interval


def test_the_interval_resamples_seeds_within_each_cell():
    assert relative_interval([1.1] * 3, [1.0] * 3) == pytest.approx((0.1, 0.1, 0.1))
    point, low, high = relative_interval([1.0, 1.1, 1.2], [1.0, 1.0, 1.0])
    # the resampled means of the subject run from 1.0 to 1.2: the interval lies within, around 10%
    assert point == pytest.approx(0.1) and 0.0 <= low < point < high <= 0.2


def test_the_best_lr_is_tuned_over_the_lrs_with_every_seed():
    """A one-seed lr that ended lower than a three-seed mean is luck until its seeds run; a diverged seed (inf)
    rules its lr out."""
    grid = {0.1: {0: 1.50, 1: 1.54, 2: 1.52}, 0.2: {0: 1.49}, 0.05: {0: 1.40, 1: float("inf"), 2: 1.41}}
    assert best_lr(grid) == 0.1 and best_lr(grid, seeds=1) == 0.2 and best_lr({}) is None
