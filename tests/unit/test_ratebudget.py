"""The rate budget's pure parts: paces from settings, the window bound, budget keys and the account setting;
the simulator's per-account token bucket."""

from __future__ import annotations

import math

import pytest

from streams.config import Settings, budget_key
from streams.coordination.ratebudget import Pace
from streams.errors import ConfigError
from streams_harness.simulator.ratelimit import AccountLimiter, TokenBucket, retry_after_header


@pytest.mark.parametrize(
    ("rate", "burst", "interval_us"),
    [(0.0, 1, 0), (1.0, 1, 1_000_000), (3.0, 2, 333_334), (20.0, 5, 50_000), (1e6, 1, 1), (0.5, 1, 2_000_000)],
)
def test_pace_from_rate_rounds_the_interval_up(rate: float, burst: int, interval_us: int) -> None:
    pace = Pace.from_rate(rate, burst)
    assert (pace.interval_us, pace.burst, pace.paced) == (interval_us, burst, rate > 0)
    if rate:
        assert 1_000_000 / pace.interval_us <= rate  # never faster than the rate


@pytest.mark.parametrize(("rate", "burst"), [(-1.0, 1), (math.inf, 1), (math.nan, 1), (5.0, 0)])
def test_pace_refuses_bad_values(rate: float, burst: int) -> None:
    with pytest.raises(ValueError):
        Pace.from_rate(rate, burst)


@pytest.mark.parametrize(
    ("rate", "burst", "window_s", "bound"),
    [
        (10.0, 1, 1.0, 11),
        (10.0, 3, 1.0, 13),
        (10.0, 3, 0.0, 3),
        (4.0, 2, 0.3, 3),
        (4.0, 2, 0.25, 3),
        (0.0, 1, 1.0, None),
    ],
)
def test_window_bound(rate: float, burst: int, window_s: float, bound: int | None) -> None:
    assert Pace.from_rate(rate, burst).window_bound(window_s) == bound


def test_budget_settings_and_keys() -> None:
    s = Settings()
    assert (s.remote_account, s.remote_post_rate_per_s, s.remote_get_rate_per_s) == ("default", 0.0, 0.0)
    assert (s.remote_post_burst, s.remote_get_burst) == (1, 1)
    assert budget_key(s, "POST", "tat") == "app:budget:{default}:POST:tat"
    s = Settings.from_env(
        {
            "STREAMS_REMOTE_ACCOUNT": "acme-prod.eu",
            "STREAMS_REMOTE_POST_RATE_PER_S": "2.5",
            "STREAMS_REMOTE_GET_BURST": "7",
            "STREAMS_LEASE_KEY_PREFIX": "x",
        }
    )
    assert (s.remote_post_rate_per_s, s.remote_get_burst) == (2.5, 7)
    assert budget_key(s, "GET", "pause") == "x:budget:{acme-prod.eu}:GET:pause"


@pytest.mark.parametrize(
    ("var", "raw", "says"),
    [
        ("STREAMS_REMOTE_ACCOUNT", "acme prod", "STREAMS_REMOTE_ACCOUNT='acme prod'"),
        ("STREAMS_REMOTE_ACCOUNT", "", "STREAMS_REMOTE_ACCOUNT=''"),
        ("STREAMS_REMOTE_ACCOUNT", "a{b}", "STREAMS_REMOTE_ACCOUNT='a{b}'"),
        ("STREAMS_REMOTE_POST_RATE_PER_S", "-1", "STREAMS_REMOTE_POST_RATE_PER_S='-1' must not be negative"),
        ("STREAMS_REMOTE_GET_RATE_PER_S", "inf", "STREAMS_REMOTE_GET_RATE_PER_S='inf'"),
        ("STREAMS_REMOTE_GET_BURST", "0", "STREAMS_REMOTE_GET_BURST must be at least 1"),
    ],
)
def test_bad_budget_settings_are_refused_by_name(var: str, raw: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        Settings.from_env({var: raw})
    assert says in str(err.value)


def test_token_bucket_rate_and_burst() -> None:
    bucket = TokenBucket(rate_per_s=10.0, burst=3, tokens=3.0, updated=100.0)
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(100.0) == pytest.approx(0.1)  # refused: a token in 100 ms
    assert bucket.take(100.05) == pytest.approx(0.05)
    assert bucket.take(100.1) == 0.0
    assert bucket.take(110.0) == 0.0 and bucket.tokens == pytest.approx(2.0)  # refilled to the burst, not beyond


def test_account_limiter_counts_refusals_per_method_and_account() -> None:
    limiter = AccountLimiter()
    assert limiter.check("a", "POST", 0.0, 1, 0.0) is None  # no limit set
    assert limiter.check("a", "POST", 2.0, 1, 0.0) is None
    assert limiter.check("a", "POST", 2.0, 1, 0.1) == pytest.approx(0.4)
    assert limiter.check("a", "GET", 2.0, 1, 0.1) is None  # GETs apart
    assert limiter.check("b", "POST", 2.0, 1, 0.1) is None  # accounts apart
    assert limiter.check("a", "POST", 2.0, 1, 0.5) is None
    assert dict(limiter.refused) == {"POST": 1}
    limiter.clear()
    assert not limiter.refused and not limiter.buckets


@pytest.mark.parametrize(("wait_s", "header"), [(0.01, "1"), (1.0, "1"), (1.2, "2"), (0.0, "1")])
def test_retry_after_is_whole_seconds_rounded_up(wait_s: float, header: str) -> None:
    assert retry_after_header(wait_s) == header
