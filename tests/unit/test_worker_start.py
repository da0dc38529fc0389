"""When a worker that stopped starts again (streams/worker/process.py): only after an outage, a bounded number of times
in a row (a crash long after the start begins a new series)."""

from __future__ import annotations

import gc
import weakref

import aiokafka.errors
import asyncpg
import faust
import pytest

from streams.errors import ServiceNotReadyError
from streams.worker.process import GC_THRESHOLDS, MAX_START_ATTEMPTS, STABLE_UPTIME_S, StreamsWorker, next_attempt


@pytest.mark.parametrize(
    "failure",
    [
        aiokafka.errors.KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 9092)]"),
        aiokafka.errors.NotLeaderForPartitionError(),
        ConnectionRefusedError(111, "Connect call failed"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
    ],
)
def test_an_outage_during_start_up_starts_again_until_the_attempts_run_out(failure: BaseException) -> None:
    assert [next_attempt(failure, attempt) for attempt in range(1, MAX_START_ATTEMPTS + 1)] == [2, 3, 4, 5, None]


def test_a_crash_soon_after_the_start_counts_as_one_more_attempt() -> None:
    outage = aiokafka.errors.NodeNotReadyError("node 1 not ready")
    assert next_attempt(outage, 1, uptime_s=1.0) == 2
    assert next_attempt(outage, 4, uptime_s=STABLE_UPTIME_S - 0.1) == 5
    assert next_attempt(outage, MAX_START_ATTEMPTS, uptime_s=STABLE_UPTIME_S - 0.1) is None


def test_a_crash_long_after_the_start_begins_a_new_series() -> None:
    outage = aiokafka.errors.NodeNotReadyError("node 1 not ready")
    assert next_attempt(outage, MAX_START_ATTEMPTS, uptime_s=STABLE_UPTIME_S) == 2
    assert next_attempt(TypeError("a bug"), 1, uptime_s=STABLE_UPTIME_S) is None


def test_the_failure_is_the_start_up_one_else_fausts_crash_reason() -> None:
    worker = object.__new__(StreamsWorker)  # the properties need no more than these attributes
    worker.startup_failure, worker._crash_reason, worker.started_monotonic = None, None, None
    assert worker.failure is None and worker.uptime_s() == 0.0
    crash = aiokafka.errors.NodeNotReadyError("node 1 not ready")
    worker._crash_reason = crash
    assert worker.failure is crash
    startup = aiokafka.errors.KafkaConnectionError("Unable to bootstrap")
    worker.startup_failure = startup
    assert worker.failure is startup


def test_a_stop_signal_is_remembered() -> None:
    worker = object.__new__(StreamsWorker)
    assert worker.stop_requested is False  # mode's class default: no signal yet
    worker._signal_stop_time = 12.5
    assert worker.stop_requested is True


@pytest.mark.parametrize(
    "failure",
    [
        None,  # started, then stopped (SIGTERM) or stopped cleanly
        TypeError("a bug"),
        ServiceNotReadyError("kafka", "did not answer within 300 s"),  # the start-up wait itself ran out
        aiokafka.errors.RecordTooLargeError(),  # a refusal, not an outage
    ],
)
def test_anything_else_ends_the_process(failure: BaseException | None) -> None:
    assert next_attempt(failure, 1) is None


class _Cycle:
    """An object that refers to itself: only the cyclic garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self


async def test_started_freezes_only_live_objects_not_the_garbage_waiting_for_a_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cyclic garbage left by the start-up (e.g. the exceptions and frames of refused connections while waiting for
    the services) is collected before ``gc.freeze()``: a frozen object is never collected again. Then the collector
    runs at the worker's thresholds (a young collection after 5,000 allocations, not CPython's 700)."""

    async def faust_started(self: faust.Worker) -> None:
        return None

    monkeypatch.setattr(faust.Worker, "on_started", faust_started)
    worker = object.__new__(StreamsWorker)  # on_started needs no more than the instance
    was_enabled = gc.isenabled()
    thresholds = gc.get_threshold()
    gc.disable()  # no collection between making the garbage and the worker's start, as between two thresholds
    try:
        garbage = _Cycle()
        collected = weakref.ref(garbage)
        del garbage
        await worker.on_started()
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert collected() is None
        assert gc.get_threshold() == (5_000, 10, 10) == GC_THRESHOLDS
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        if was_enabled:
            gc.enable()
