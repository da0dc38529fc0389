"""When a worker that stopped during start-up starts again (streams/worker.py): only after an outage, and a
bounded number of times."""

from __future__ import annotations

import aiokafka.errors
import asyncpg
import pytest

from streams.errors import ServiceNotReadyError
from streams.worker import MAX_START_ATTEMPTS, restart_after


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
