"""Delay before the next poll: the API's hint wins (clamped), otherwise capped exponential with equal jitter."""

from __future__ import annotations

import random

import pytest

from streams.backoff import next_poll_delay_s

BASE, CAP, MIN = 0.5, 30.0, 0.05


def delay(
    poll_count: int,
    hint: float | None,
    rng: random.Random | None = None,
    base_s: float = BASE,
    hints_trusted_polls: int | None = None,
) -> float:
    return next_poll_delay_s(
        poll_count, hint, base_s=base_s, cap_s=CAP, min_s=MIN, rng=rng, hints_trusted_polls=hints_trusted_polls
    )


@pytest.mark.parametrize(
    ("hint", "expected"),
    [
        (3.0, 3.0),
        (0.25, 0.25),
        (0.0, MIN),
        (-5.0, MIN),
        (0.01, MIN),
        (30.0, 30.0),
        (31.0, CAP),
        (3600.0, CAP),
    ],
)
def test_hint_is_clamped(hint: float, expected: float) -> None:
    # The hint wins regardless of poll_count and never consults the random source.
    for poll_count in (0, 5, 100):
        assert delay(poll_count, hint, rng=random.Random(0)) == expected


def test_hint_does_not_consume_randomness() -> None:
    rng = random.Random(7)
    delay(3, 1.0, rng=rng)
    assert rng.random() == random.Random(7).random()


@pytest.mark.parametrize("poll_count", [0, 1, 2, 3, 4, 5, 6])
def test_without_hint_exact_with_seed(poll_count: int) -> None:
    ceiling = min(CAP, BASE * 2**poll_count)
    expected = max(MIN, ceiling / 2 + random.Random(42).uniform(0, ceiling / 2))
    assert delay(poll_count, None, rng=random.Random(42)) == expected


def test_without_hint_first_values() -> None:
    # Ceilings for base 0.5, cap 30: 0.5, 1, 2, 4, 8, 16, 30, 30 ...
    expected_ceilings = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    rng = random.Random(1234)
    for poll_count, ceiling in enumerate(expected_ceilings):
        d = delay(poll_count, None, rng=rng)
        assert ceiling / 2 <= d <= ceiling, (poll_count, d)


@pytest.mark.parametrize("seed", range(20))
def test_bounds_many_seeds(seed: int) -> None:
    rng = random.Random(seed)
    for poll_count in range(40):
        ceiling = min(CAP, BASE * 2**poll_count)
        d = delay(poll_count, None, rng=rng)
        assert max(MIN, ceiling / 2) <= d <= ceiling


def test_never_below_min() -> None:
    # base 0.01 -> ceiling 0.01 at poll 0, jitter range [0.005, 0.01], floor 0.05 wins.
    for seed in range(10):
        assert delay(0, None, rng=random.Random(seed), base_s=0.01) == MIN


@pytest.mark.parametrize("poll_count", [6, 7, 30, 31, 64, 1000, 10**9])
def test_cap_reached_for_large_poll_count(poll_count: int) -> None:
    expected = CAP / 2 + random.Random(5).uniform(0, CAP / 2)
    d = delay(poll_count, None, rng=random.Random(5))
    assert d == expected
    assert CAP / 2 <= d <= CAP


def test_jitter_extremes() -> None:
    class Fixed(random.Random):
        def __init__(self, value: float) -> None:
            super().__init__(0)
            self.value = value

        def uniform(self, a: float, b: float) -> float:
            return a + (b - a) * self.value

    assert delay(3, None, rng=Fixed(0.0)) == 2.0
    assert delay(3, None, rng=Fixed(1.0)) == 4.0
    assert delay(3, None, rng=Fixed(0.5)) == 3.0
    assert delay(100, None, rng=Fixed(1.0)) == CAP


def test_hints_are_trusted_for_the_first_polls_then_a_capped_exponential_floor_applies() -> None:
    # A provider answering "poll again in 50 ms" for a job that never finishes.
    delays = [delay(n, 0.05, rng=random.Random(0), hints_trusted_polls=8) for n in range(20)]
    assert delays[:8] == [0.05] * 8
    assert delays[8:16] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert delays[16:] == [CAP] * 4
    # A hint longer than the floor still wins.
    assert delay(9, 5.0, hints_trusted_polls=8) == 5.0
    # Without the setting, the hint wins forever.
    assert delay(100, 0.05, hints_trusted_polls=None) == 0.05


def test_gets_of_a_job_that_never_finishes_are_bounded_by_the_age_over_the_cap() -> None:
    elapsed, gets, age_s = 0.0, 0, 86_400.0
    while elapsed < age_s:
        elapsed += delay(gets, 0.05, hints_trusted_polls=8)
        gets += 1
    assert gets <= 8 + 7 + age_s / CAP + 1  # trusted hints, the ramp, then one GET per cap
