"""The benchmarks' bootstrap interval (`common.bootstrap`): scipy's BCa over groups resampled each within
itself, seeded, with a stated rule for what cannot be resampled."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy import stats

from kvlens.experiments.bench.common import bootstrap


def test_a_value_is_never_resampled_into_another_group():
    # pooled resampling would mix 0/1s and 100/101s in varying numbers: an interval about 30 wide around 50.5
    low, high = bootstrap([[0.0, 1.0] * 10, [100.0, 101.0] * 10])
    assert 50.0 < low < 50.5 < high < 51.0


def test_the_interval_is_of_the_mean_of_the_groups_means_not_of_the_pooled_values():
    # groups' means 0.5 and 10.5: their mean 5.5; the 40 values' mean 9.5
    low, high = bootstrap([[0.0, 1.0] * 2, [10.0, 11.0] * 18])
    assert low < 5.5 < high < 7.0


def test_one_group_gets_scipys_bca_interval_with_the_seeded_generator():
    values = np.random.default_rng(7).exponential(size=25)
    expected = stats.bootstrap((values,), np.mean, method="BCa", rng=np.random.default_rng(3))
    assert bootstrap([list(values)], seed=3) == pytest.approx(tuple(expected.confidence_interval), abs=1e-12)


def test_the_same_seed_gives_the_same_interval_and_another_seed_another():
    groups = [list(np.random.default_rng(1).normal(size=30)), list(np.random.default_rng(2).normal(size=12))]
    assert bootstrap(groups) == bootstrap(groups) == bootstrap(groups, seed=0)
    assert bootstrap(groups, seed=1) != bootstrap(groups, seed=0)


def test_what_resampling_cannot_move_is_held_fixed_and_no_spread_is_no_interval():
    assert bootstrap([[0.25, 0.25, 0.25]]) == (0.25, 0.25)
    assert bootstrap([[1.0], [0.0]]) == (0.5, 0.5)  # one sample per group: nothing to resample
    # a one-value group (and a constant one) adds a constant to the mean of means
    low, high = bootstrap([[0.0, 1.0, 1.0, 0.0, 1.0]])
    assert bootstrap([[3.0], [0.0, 1.0, 1.0, 0.0, 1.0], [2.0, 2.0]]) == pytest.approx(
        ((3 + low + 2) / 3, (3 + high + 2) / 3)
    )
    with pytest.raises(ValueError):
        bootstrap([[1.0], []])


def test_an_undefined_bca_interval_falls_back_to_the_percentile_one_without_a_warning():
    values = [0.0, 0.0, 1.0]  # with 2 resamples, some seeds put both on one side of the mean: BCa is nan
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        seed = next(
            s
            for s in range(100)
            if np.isnan(
                stats.bootstrap(
                    (values,), np.mean, n_resamples=2, rng=np.random.default_rng(s)
                ).confidence_interval.low
            )
        )
    percentile = stats.bootstrap(
        (values,), np.mean, n_resamples=2, method="percentile", rng=np.random.default_rng(seed)
    ).confidence_interval
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bootstrap([values], seed=seed, resamples=2) == pytest.approx(tuple(percentile))
