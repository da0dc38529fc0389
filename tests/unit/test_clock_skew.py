"""When a measured skew of the worker's clock is logged, and its settings' bounds."""

from __future__ import annotations

import logging

import pytest

from streams.config import Settings
from streams.errors import ConfigError
from streams.ledger.snapshot import ClockOffset
from streams.worker.clock import skew_log_level


@pytest.mark.parametrize(
    ("skew_s", "previous_s", "level"),
    [
        (0.2, None, logging.INFO),  # the first measurement is always logged
        (0.2, 0.1, None),  # within the threshold again: silent
        (-1.5, 0.1, logging.WARNING),  # past it, either way: every time
        (120.0, 120.0, logging.WARNING),
        (0.3, 120.0, logging.INFO),  # back within it after a warning: said once
        (1.0, None, logging.INFO),  # the threshold itself is within
    ],
)
def test_a_skew_is_logged_past_the_threshold_and_once_otherwise(
    skew_s: float, previous_s: float | None, level: int | None
) -> None:
    previous = None if previous_s is None else ClockOffset(previous_s, 0.001)
    assert skew_log_level(skew_s, 1.0, previous) == level


def test_the_clock_check_interval_must_be_positive() -> None:
    assert Settings(clock_check_interval_s=5.0).clock_check_interval_s == 5.0
    with pytest.raises(ConfigError, match="STREAMS_CLOCK_CHECK_INTERVAL_S must be more than 0 seconds"):
        Settings(clock_check_interval_s=0)
