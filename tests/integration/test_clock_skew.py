"""The worker's clock measured against PostgreSQL's: the skew read, logged and exported (real PostgreSQL)."""

from __future__ import annotations

import logging
import time

import asyncpg
import pytest

from streams import metrics
from streams.config import Settings
from streams.ledger.snapshot import read_clock_offset
from streams.ledger.store import Ledger
from streams.worker.clock import ClockCheck


async def test_the_skew_of_a_clock_on_time_is_within_its_round_trip(pool: asyncpg.Pool) -> None:
    # The database runs on this machine: the same clock, so the skew is at most half the round trip (plus the
    # microsecond of the readings).
    reading = await read_clock_offset(pool)
    assert 0.0 <= reading.round_trip_s < 1.0
    assert abs(reading.skew_s) <= reading.round_trip_s / 2 + 0.002


@pytest.mark.parametrize("shift_s", [120.0, -120.0])
async def test_a_shifted_clock_is_measured_logged_and_exported(
    pool: asyncpg.Pool, migrated: Settings, shift_s: float, caplog: pytest.LogCaptureFixture
) -> None:
    check = ClockCheck(pool, migrated.replace(clock_skew_warn_s=1.0), clock=lambda: time.time() + shift_s)
    with caplog.at_level(logging.INFO, logger="streams.worker.clock"):
        reading = await check.check()
    assert reading is not None and abs(reading.skew_s - shift_s) <= reading.round_trip_s / 2 + 0.002
    assert metrics.CLOCK_SKEW_SECONDS._value.get() == reading.skew_s
    [record] = [r for r in caplog.records if r.name == "streams.worker.clock"]
    assert record.levelno == logging.WARNING
    assert f"{shift_s:+.0f}." in record.getMessage() and "off PostgreSQL's" in record.getMessage()


async def test_a_clock_back_within_the_threshold_is_logged_once_at_info(
    pool: asyncpg.Pool, migrated: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    shift = {"s": 5.0}
    check = ClockCheck(pool, migrated.replace(clock_skew_warn_s=1.0), clock=lambda: time.time() + shift["s"])
    with caplog.at_level(logging.INFO, logger="streams.worker.clock"):
        await check.check()  # 5 s ahead: WARNING
        shift["s"] = 0.0
        await check.check()  # back: INFO
        await check.check()  # still fine: no line
    levels = [r.levelno for r in caplog.records if r.name == "streams.worker.clock"]
    assert levels == [logging.WARNING, logging.INFO]
    assert abs(metrics.CLOCK_SKEW_SECONDS._value.get()) < 0.5


async def test_a_poll_claim_is_stamped_on_the_database_clock(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The poll record's claimed_at_ms comes from the claim's now(), whatever this worker's wall clock says.
    ledger = Ledger(pool, "skewed")
    assert await ledger.accept("clock-op", '{"prompt": "x"}', submitted_at_ms=1)
    fencing = await ledger.claim_for_submit("clock-op")
    assert fencing is not None and await ledger.save_submitted("clock-op", fencing, "job-clock", 0.0, None)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 120.0)
    (poll,) = await ledger.claim_due_polls(10, 60.0)
    monkeypatch.setattr(time, "time", real_time)
    claimed_at = await pool.fetchval("SELECT poll_claimed_at FROM operations WHERE operation_id = 'clock-op'")
    assert poll.claimed_at_ms == int(claimed_at.timestamp() * 1000)
    assert abs(poll.claimed_at_ms / 1000 - real_time()) < 5.0
