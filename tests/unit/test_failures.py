"""The failure classifier as a table over the real exception classes of asyncpg, redis-py, aiokafka and faust."""

from __future__ import annotations

import aiokafka.errors as kafka
import asyncpg
import faust.exceptions
import pytest
import redis.exceptions

from streams.errors import (
    CoordinationBusyError,
    CoordinationUnavailableError,
    DeadLetterError,
    InvalidEventError,
    LeaseLostError,
    LedgerDataError,
    LedgerUnavailableError,
)
from streams.outages import Failure, FailureKind, classify

OUTAGE, BUSY, ERROR = FailureKind.OUTAGE, FailureKind.BUSY, FailureKind.ERROR


def chained(outer: BaseException, cause: BaseException) -> BaseException:
    """``outer`` as if raised ``from cause``."""
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        # PostgreSQL
        (LedgerUnavailableError("PostgreSQL unavailable during claim"), Failure(OUTAGE, "PostgreSQL")),
        (asyncpg.ConnectionDoesNotExistError("connection was closed"), Failure(OUTAGE, "PostgreSQL")),
        (asyncpg.CannotConnectNowError("the database system is starting up"), Failure(OUTAGE, "PostgreSQL")),
        (asyncpg.AdminShutdownError("terminating connection"), Failure(OUTAGE, "PostgreSQL")),
        (asyncpg.TooManyConnectionsError("too many clients"), Failure(OUTAGE, "PostgreSQL")),
        (asyncpg.InterfaceError("connection is closed"), Failure(OUTAGE, "PostgreSQL")),
        # an InterfaceError too, but a setting asyncpg refuses before connecting: waiting cannot fix it
        (asyncpg.ClientConfigurationError("`sslmode` parameter must be one of: ..."), Failure(ERROR)),
        (asyncpg.UniqueViolationError("duplicate key"), Failure(ERROR)),
        (asyncpg.UndefinedColumnError("column does not exist"), Failure(ERROR)),
        (LedgerDataError("PostgreSQL refused the values"), Failure(ERROR)),
        # Redis
        (CoordinationUnavailableError("Redis unavailable"), Failure(OUTAGE, "Redis")),
        (redis.exceptions.ConnectionError("Error 111 connecting"), Failure(OUTAGE, "Redis")),
        (redis.exceptions.TimeoutError("Timeout reading from socket"), Failure(OUTAGE, "Redis")),
        (redis.exceptions.BusyLoadingError("Redis is loading the dataset"), Failure(OUTAGE, "Redis")),
        (redis.exceptions.MaxConnectionsError("Too many connections"), Failure(BUSY, "Redis")),
        (CoordinationBusyError("no Redis connection came free"), Failure(BUSY, "Redis")),
        (redis.exceptions.ResponseError("WRONGTYPE"), Failure(ERROR)),
        (redis.exceptions.NoScriptError("NOSCRIPT"), Failure(ERROR)),
        (LeaseLostError("app:observe:x"), Failure(ERROR)),
        # Kafka (aiokafka directly, and wrapped by faust's producer)
        (kafka.KafkaConnectionError("Unable to bootstrap"), Failure(OUTAGE, "Kafka")),
        (kafka.KafkaTimeoutError(), Failure(OUTAGE, "Kafka")),
        (kafka.RequestTimedOutError(), Failure(OUTAGE, "Kafka")),
        (kafka.NotLeaderForPartitionError(), Failure(OUTAGE, "Kafka")),
        (kafka.LeaderNotAvailableError(), Failure(OUTAGE, "Kafka")),
        (kafka.NotEnoughReplicasError(), Failure(OUTAGE, "Kafka")),
        (kafka.MessageSizeTooLargeError(), Failure(ERROR)),
        (kafka.TopicAuthorizationFailedError(), Failure(ERROR)),
        (kafka.UnsupportedVersionError(), Failure(ERROR)),
        (faust.exceptions.NotReady("Producer service not yet started"), Failure(OUTAGE, "Kafka")),
        (
            chained(faust.exceptions.ProducerSendError("Error while sending"), kafka.KafkaConnectionError()),
            Failure(OUTAGE, "Kafka"),
        ),
        (
            chained(faust.exceptions.ProducerSendError("Error while sending"), kafka.MessageSizeTooLargeError()),
            Failure(ERROR),
        ),
        # sockets a library let through
        (ConnectionRefusedError(111, "Connection refused"), Failure(OUTAGE, "network")),
        (ConnectionResetError(104, "Connection reset by peer"), Failure(OUTAGE, "network")),
        (TimeoutError(), Failure(OUTAGE, "network")),
        (chained(RuntimeError("send failed"), ConnectionResetError()), Failure(OUTAGE, "network")),
        # programming errors and our own refusals: never an outage
        (TypeError("unsupported operand"), Failure(ERROR)),
        (KeyError("topic_role"), Failure(ERROR)),
        (AttributeError("'NoneType' object has no attribute 'encode'"), Failure(ERROR)),
        (ValueError("bad value"), Failure(ERROR)),
        (RuntimeError("no cause"), Failure(ERROR)),
        (InvalidEventError("schema", "bad"), Failure(ERROR)),
        (DeadLetterError("not published"), Failure(ERROR)),
        (chained(LedgerDataError("refused"), ConnectionResetError()), Failure(ERROR)),  # classified on purpose
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None,
)
def test_classify(exc: BaseException, expected: Failure) -> None:
    assert classify(exc) == expected


def test_a_cause_chain_is_followed_only_so_far() -> None:
    exc: BaseException = ConnectionResetError()
    for _ in range(10):
        exc = chained(RuntimeError("wrapper"), exc)
    assert classify(exc) == Failure(ERROR)
