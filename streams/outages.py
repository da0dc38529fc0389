"""What a caught exception means, decided by its type: an outage, this worker being busy, or a bug.

=========================================================== ========= ==================================
exception (or, for a wrapper, the exception it chains)      kind      what the caller does
=========================================================== ========= ==================================
``LedgerUnavailableError``; asyncpg connection errors,      OUTAGE    wait it out (log at most every 5 s
``InterfaceError``, ``InternalClientError``, class 53/57              per service, count it)
(too many connections,
shutdown, cannot connect now)
``CoordinationUnavailableError``; redis ``ConnectionError``, OUTAGE
``TimeoutError``, ``BusyLoadingError``
aiokafka ``KafkaConnectionError``, ``KafkaTimeoutError``,    OUTAGE
any ``KafkaError`` marked retriable (no leader, request
timed out, not enough replicas, ...); faust ``NotReady``
``OSError``/``TimeoutError`` a library let through          OUTAGE    (service "network")
asyncpg ``ClientConfigurationError``, an ``InterfaceError`` ERROR     a wrong setting (the URL):
(a URL parameter it refuses: ``sslmode=bogus``)                       waiting cannot fix it
``CoordinationBusyError``, redis ``MaxConnectionsError``    BUSY      retry shortly; not an outage
anything else: ``TypeError``, ``KeyError``, a non-retriable ERROR     log with traceback, count in
``KafkaError`` (record too large, authorization), an                  ``streams_unexpected_errors_total``;
integrity error, ...                                                  never reported as an outage
=========================================================== ========= ==================================

A wrapper that does not classify itself (faust's ``ProducerSendError``, a ``RuntimeError`` raised ``from`` a
socket error) is classified by the exception it chains as its ``__cause__``.

faust is not imported here: it costs the operators' commands, which import this module through the ledger, and
run no faust. Its ``NotReady`` is looked up among the loaded modules (:func:`_faust_outages`): an exception of a
faust class exists only once faust has been imported.
"""

from __future__ import annotations

import asyncio
import enum
import sys
from dataclasses import dataclass

import aiokafka.errors
import asyncpg
import redis.exceptions

from streams.errors import (
    CoordinationBusyError,
    CoordinationUnavailableError,
    LedgerUnavailableError,
    StreamsError,
)


class FailureKind(enum.StrEnum):
    """What a failure calls for."""

    OUTAGE = "outage"  # a service did not answer: wait, retry, never drop work
    BUSY = "busy"  # this worker's own pool had nothing free: retry shortly
    ERROR = "error"  # a programming error or a refusal that waiting cannot fix: surface loudly


@dataclass(frozen=True)
class Failure:
    """A classified exception: its ``kind`` and the ``service`` concerned (``PostgreSQL``, ``Redis``, ``Kafka``,
    ``network``; empty for :attr:`FailureKind.ERROR`)."""

    kind: FailureKind
    service: str = ""


POSTGRES_OUTAGE: tuple[type[BaseException], ...] = (
    LedgerUnavailableError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    # raised when a connection broke mid-operation and its protocol state is left inconsistent
    asyncpg.InternalClientError,
    # class 53: too many connections, out of memory or disk; transient from a worker's point of view
    asyncpg.InsufficientResourcesError,
    # 57014: the statement was cancelled (an operator's pg_cancel_backend, a statement_timeout): nothing was
    # written and running it again is safe
    asyncpg.QueryCanceledError,
)
REDIS_OUTAGE: tuple[type[BaseException], ...] = (
    CoordinationUnavailableError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)
REDIS_BUSY: tuple[type[BaseException], ...] = (CoordinationBusyError, redis.exceptions.MaxConnectionsError)
KAFKA_OUTAGE: tuple[type[BaseException], ...] = (
    aiokafka.errors.KafkaConnectionError,
    aiokafka.errors.KafkaTimeoutError,
)
#: faust's exceptions that are Kafka outages, by module and class name (see the module docstring).
FAUST_KAFKA_OUTAGE = (("faust.exceptions", "NotReady"),)

_WRAPPER_DEPTH = 5


def classify(exc: BaseException) -> Failure:
    """Classify ``exc`` by its type (see the module table). Never raises."""
    for _ in range(_WRAPPER_DEPTH):
        failure = _classify_one(exc)
        if failure is not None:
            return failure
        cause = exc.__cause__
        if cause is None:
            break
        exc = cause
    return Failure(FailureKind.ERROR)


def is_outage(exc: BaseException) -> bool:
    """True when ``exc`` is an outage (:attr:`FailureKind.OUTAGE` by :func:`classify`): retrying the same call
    later can succeed. The one rule the ledger, the readiness checks and the Kafka admin calls retry by."""
    return classify(exc).kind is FailureKind.OUTAGE


def _classify_one(exc: BaseException) -> Failure | None:
    if isinstance(exc, asyncpg.ClientConfigurationError):  # before POSTGRES_OUTAGE: it is an InterfaceError
        return Failure(FailureKind.ERROR)
    if isinstance(exc, REDIS_BUSY):  # before REDIS_OUTAGE: MaxConnectionsError is a ConnectionError
        return Failure(FailureKind.BUSY, "Redis")
    if isinstance(exc, POSTGRES_OUTAGE):
        return Failure(FailureKind.OUTAGE, "PostgreSQL")
    if isinstance(exc, REDIS_OUTAGE):
        return Failure(FailureKind.OUTAGE, "Redis")
    if (
        isinstance(exc, KAFKA_OUTAGE)
        or (isinstance(exc, aiokafka.errors.KafkaError) and exc.retriable)
        or isinstance(exc, _faust_outages())
    ):
        return Failure(FailureKind.OUTAGE, "Kafka")
    if isinstance(exc, aiokafka.errors.KafkaError | StreamsError):
        return Failure(FailureKind.ERROR)  # classified on purpose: a refusal or a bug, not an outage
    if isinstance(exc, OSError | asyncio.TimeoutError):
        return Failure(FailureKind.OUTAGE, "network")
    return None


def _faust_outages() -> tuple[type[BaseException], ...]:
    """The classes of :data:`FAUST_KAFKA_OUTAGE` whose module is loaded (none before faust is imported)."""
    return tuple(getattr(sys.modules[module], name) for module, name in FAUST_KAFKA_OUTAGE if module in sys.modules)
