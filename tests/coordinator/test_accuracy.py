"""A run's late gain: the mean of its last rounds against the mean of the same number before."""

from __future__ import annotations

import pytest

from coordinator.accuracy import late_gain


def test_late_gain_compares_the_last_window_with_the_one_before() -> None:
    values = [0.1] * 5 + [0.5] * 10 + [0.8] * 10  # only the last 20 count
    assert late_gain(values) == pytest.approx(0.3)
    assert late_gain(values, last=5) == pytest.approx(0.0)


def test_late_gain_is_negative_for_a_run_past_its_best() -> None:
    assert late_gain([0.9] * 10 + [0.7] * 10) == pytest.approx(-0.2)


@pytest.mark.parametrize("values", [[], [0.5] * 19])
def test_late_gain_needs_two_whole_windows(values: list[float]) -> None:
    assert late_gain(values) is None
