"""Which Kafka admin errors are retried, and how a call ends (retry logic only; the broker tests are in
tests/integration/test_kafka_admin.py and tests/e2e/test_fresh_broker.py)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import aiokafka.errors as ke
import pytest

from streams.config import Settings
from streams.errors import KafkaAdminError, StreamsError
from streams.outages import is_outage
from streams.setup.admin import KafkaAdmin


@pytest.mark.parametrize(
    "exc",
    [
        ke.GroupCoordinatorNotAvailableError("no coordinator yet"),
        ke.NotCoordinatorForGroupError(),
        ke.CoordinatorLoadInProgressError(),
        ke.LeaderNotAvailableError(),
        ke.NotControllerError(),
        ke.RequestTimedOutError(),
        ke.KafkaConnectionError("refused"),
        ke.NodeNotReadyError(),
        ke.KafkaTimeoutError(),
        ke.for_code(15)("from an error code"),  # COORDINATOR_NOT_AVAILABLE, as a response carries it
        ke.for_code(14)("from an error code"),  # COORDINATOR_LOAD_IN_PROGRESS
        ConnectionRefusedError(111, "Connection refused"),
        ConnectionResetError(104, "Connection reset by peer"),
        TimeoutError(),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_retriable(exc: BaseException) -> None:
    assert is_outage(exc) is True


@pytest.mark.parametrize(
    "exc",
    [
        ke.InvalidTopicError("bad name"),
        ke.for_code(17)("from an error code"),  # INVALID_TOPIC_EXCEPTION
        ke.TopicAuthorizationFailedError(),
        ke.PolicyViolationError(),
        ke.InvalidReplicationFactorError(),
        ke.UnsupportedVersionError(),
        ValueError("not a broker error"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_definite(exc: BaseException) -> None:
    assert is_outage(exc) is False


class ScriptedAdmin(KafkaAdmin):
    """A KafkaAdmin whose client is a stand-in: the requests below never touch it."""

    async def _connected(self) -> Any:
        return object()


def scripted(outcomes: list[BaseException | str]) -> tuple[Any, list[float]]:
    """A request that raises (or returns) ``outcomes`` in order, recording when each attempt ran."""
    calls: list[float] = []

    async def request(client: Any) -> str:
        calls.append(time.monotonic())
        outcome = outcomes[min(len(calls), len(outcomes)) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return request, calls


async def test_retriable_errors_are_retried_until_success() -> None:
    request, calls = scripted(
        [ke.GroupCoordinatorNotAvailableError(), ke.CoordinatorLoadInProgressError(), ke.NotCoordinatorError(), "ok"]
    )
    admin = ScriptedAdmin(Settings(), deadline_s=10)
    assert await admin.call("describe consumer group 'g'", request) == "ok"
    assert len(calls) == 4
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert all(0.05 <= gap < 2.5 for gap in gaps), gaps  # backoff 0.1 s up to 2 s, with jitter


async def test_a_definite_error_ends_at_once_with_what_failed_and_what_to_do() -> None:
    request, calls = scripted([ke.InvalidTopicError("topic name 'a b' is illegal")])
    admin = ScriptedAdmin(Settings(kafka_bootstrap="127.0.0.1:9092"), deadline_s=10)
    with pytest.raises(KafkaAdminError) as caught:
        await admin.call("create topics ['a b']", request)
    assert len(calls) == 1
    error = caught.value
    assert isinstance(error, StreamsError)
    assert error.call == "create topics ['a b']" and error.attempts == 1
    assert isinstance(error.cause, ke.InvalidTopicError)
    message = str(error)
    assert "create topics ['a b']" in message and "127.0.0.1:9092" in message
    assert "InvalidTopicError" in message and "scripts/services up" in message


async def test_retriable_errors_past_the_deadline_end_with_attempts_and_time() -> None:
    request, calls = scripted([ke.GroupCoordinatorNotAvailableError("Unable to get coordinator id for g")])
    admin = ScriptedAdmin(Settings(), deadline_s=1.0)
    started = time.monotonic()
    with pytest.raises(KafkaAdminError) as caught:
        await admin.call("describe consumer group 'g'", request)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 4.0
    assert caught.value.attempts == len(calls) >= 3
    assert f"after {len(calls)} attempts over" in str(caught.value)
    assert "GroupCoordinatorNotAvailableError" in str(caught.value)


async def test_a_per_call_deadline_overrides_the_admin_deadline() -> None:
    request, calls = scripted([ke.KafkaConnectionError("refused")])
    admin = ScriptedAdmin(Settings(), deadline_s=60)
    started = time.monotonic()
    with pytest.raises(KafkaAdminError):
        await admin.call("connect", request, deadline_s=0.5)
    assert time.monotonic() - started < 3.0
    assert len(calls) >= 2


def test_the_deadline_defaults_to_the_setting() -> None:
    assert KafkaAdmin(Settings(kafka_admin_deadline_s=7.5)).deadline_s == 7.5
    assert KafkaAdmin(Settings(), deadline_s=2.0).deadline_s == 2.0
