"""Every failed attempt at handling an event is counted and logged, rate-limited per topic, key and type."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from streams.errors import LedgerUnavailableError
from streams.worker.app import HANDLER_ATTEMPTS, HandlerFailureLog
from streams.worker.runtime import RawMessage


def _count(topic: str, kind: str, then: str) -> float:
    value = REGISTRY.get_sample_value("streams_handler_failures_total", {"topic": topic, "kind": kind, "then": then})
    return value or 0.0


def test_each_failed_attempt_is_counted_and_logged_once_per_key_and_type_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    failures = HandlerFailureLog(interval_s=10.0, clock=lambda: now[0])
    topic = "t-handler-failures"
    a = RawMessage(topic, 0, 7, b"op-a", b"{}")
    b = RawMessage(topic, 0, 8, b"op-b", b"{}")
    before_error, before_outage = _count(topic, "error", "retried"), _count(topic, "outage", "retried")
    with caplog.at_level(logging.WARNING, logger="streams.worker.app"):
        assert failures.failed(a, RuntimeError("boom"), 1) is True
        assert failures.failed(a, RuntimeError("boom"), 2) is False  # same key and type within the interval
        assert failures.failed(a, LedgerUnavailableError("down"), 3) is True  # another type
        assert failures.failed(b, RuntimeError("boom"), 1) is True  # another key
        now[0] += 10.0
        assert failures.failed(a, RuntimeError("boom"), 4) is True
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"handling {topic}[0]@7 failed (attempt 1 of {HANDLER_ATTEMPTS}, error): RuntimeError: boom; retrying",
        f"handling {topic}[0]@7 failed (attempt 3 of {HANDLER_ATTEMPTS}, outage): LedgerUnavailableError: down; "
        "retrying",
        f"handling {topic}[0]@8 failed (attempt 1 of {HANDLER_ATTEMPTS}, error): RuntimeError: boom; retrying",
        f"handling {topic}[0]@7 failed (attempt 4 of {HANDLER_ATTEMPTS}, error): RuntimeError: boom; retrying "
        "[1 more like it held back]",
    ]
    assert _count(topic, "error", "retried") - before_error == 4  # every attempt counted, logged or not
    assert _count(topic, "outage", "retried") - before_outage == 1


def test_the_keys_remembered_are_bounded() -> None:
    failures = HandlerFailureLog(interval_s=10.0, max_keys=3, clock=lambda: 0.0)
    for i in range(10):
        failures.failed(RawMessage("t-bound", 0, i, f"op-{i}".encode(), b"{}"), RuntimeError("x"), 1)
    assert len(failures._last) == 3


def test_an_error_text_is_cut_in_the_log_line(caplog: pytest.LogCaptureFixture) -> None:
    failures = HandlerFailureLog(clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, logger="streams.worker.app"):
        failures.failed(RawMessage("t-cut", 0, 1, b"op", b"{}"), RuntimeError("x" * 100_000), 1)
    assert len(caplog.records[0].getMessage()) < 700


def test_a_start_up_wait_is_explained_at_once_then_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    from streams.setup.readiness import WaitLog

    now = [0.0]
    waits = WaitLog("postgres (db:5432/streams)", interval_s=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="streams.setup.readiness"):
        for _ in range(12):  # an attempt every second
            waits.failed(OSError("sorry, too many clients already"))
            now[0] += 1.0
    assert [r.getMessage() for r in caplog.records] == [
        "postgres (db:5432/streams) not ready after 0.0 s (1 attempt), waiting: OSError: sorry, too many clients "
        "already",
        "postgres (db:5432/streams) not ready after 5.0 s (6 attempts), waiting: OSError: sorry, too many clients "
        "already",
        "postgres (db:5432/streams) not ready after 10.0 s (11 attempts), waiting: OSError: sorry, too many clients "
        "already",
    ]
