"""When a worker that stopped during start-up starts again (streams/worker.py): only after an outage, and a
bounded number of times."""

from __future__ import annotations

import gc
import weakref

import aiokafka.errors
import asyncpg
import faust
import pytest

from streams.errors import ServiceNotReadyError
from streams.worker import MAX_START_ATTEMPTS, StreamsWorker, restart_after


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
    assert [restart_after(failure, attempt) for attempt in range(1, MAX_START_ATTEMPTS + 1)] == [True] * (
        MAX_START_ATTEMPTS - 1
    ) + [False]


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
    assert restart_after(failure, 1) is False


class _Cycle:
    """An object that refers to itself: only the cyclic garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self


async def test_started_freezes_only_live_objects_not_the_garbage_waiting_for_a_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cyclic garbage left by the start-up (e.g. the exceptions and frames of refused connections while waiting for
    the services) is collected before ``gc.freeze()``: a frozen object is never collected again."""

    async def faust_started(self: faust.Worker) -> None:
        return None

    monkeypatch.setattr(faust.Worker, "on_started", faust_started)
    worker = object.__new__(StreamsWorker)  # on_started needs no more than the instance
    was_enabled = gc.isenabled()
    gc.disable()  # no collection between making the garbage and the worker's start, as between two thresholds
    try:
        garbage = _Cycle()
        collected = weakref.ref(garbage)
        del garbage
        await worker.on_started()
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert collected() is None
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
