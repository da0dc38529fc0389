"""A worker's shared resources and the waiting/retrying helpers the pipeline stages use.

One :class:`Runtime` per worker process: one asyncpg pool (the ledger), one Redis client (leases and the
account's rate budget), one ``httpx.AsyncClient`` (the remote API) and one Kafka producer (through a
:data:`SendFn`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

from streams import contracts, exactjson, metrics
from streams.codes import RemoteCallOutcome
from streams.config import Settings
from streams.errors import CoordinationUnavailableError, DeadLetterError, InvalidEventError, LedgerUnavailableError
from streams.failures import Failure, FailureKind, classify
from streams.lease import Lease, LeaseManager, make_redis
from streams.ledger import Ledger, create_pool
from streams.ratebudget import RateBudget
from streams.remote import RemoteClient

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Send one record and wait until Kafka acknowledged it: ``await send(topic, key, value)``.
SendFn = Callable[[str, bytes, bytes], Awaitable[Any]]

#: Attempts at publishing one dead letter when the failure is not an outage (e.g. the broker refuses the record
#: as too large): waiting cannot fix it, so after these the failure surfaces as :class:`DeadLetterError`.
#: Outages of Kafka are waited out without a limit (a dead letter is the event's only record).
DEAD_LETTER_ATTEMPTS = 3

#: Seconds between two log lines about the same ongoing outage.
OUTAGE_LOG_INTERVAL_S = 5.0


@dataclass(frozen=True)
class RawMessage:
    """One consumed Kafka record as raw bytes, with where it came from."""

    topic: str
    partition: int | None
    offset: int | None
    key: bytes | None
    value: bytes | None


def worker_name() -> str:
    """``<hostname>:<pid>``, written into the transition log and accounting."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Runtime:
    """Resources of one worker and the helpers that wait out outages instead of dropping work."""

    def __init__(
        self,
        settings: Settings,
        ledger: Ledger,
        leases: LeaseManager,
        remote: RemoteClient,
        send: SendFn,
        worker: str,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.leases = leases
        self.remote = remote
        self.send = send
        self.worker = worker
        self.budget = RateBudget(leases.client, settings)  # the provider account's rate budget, on the same Redis
        self._last_outage_log: dict[str, float] = {}

    @classmethod
    async def create(cls, settings: Settings, send: SendFn, worker: str | None = None) -> Runtime:
        """Connect to PostgreSQL and build the Redis and HTTP clients (Redis may still be down)."""
        name = worker or worker_name()
        database_url = settings.database_url.get_secret_value()
        pool = await create_pool(database_url, min_size=2, max_size=settings.db_pool_max_size)
        redis = make_redis(
            settings.redis_url.get_secret_value(),
            settings.redis_socket_timeout_s,
            connect_timeout_s=settings.redis_connect_timeout_s,
            max_connections=settings.redis_max_connections,
            pool_timeout_s=settings.redis_pool_timeout_s,
        )
        remote = RemoteClient.from_settings(settings)
        return cls(settings, Ledger(pool, name), LeaseManager(redis, settings.lease_ttl_ms), remote, send, name)

    async def close(self) -> None:
        """Close all clients."""
        await self.remote.aclose()
        await self.leases.client.aclose()
        await self.ledger.close()

    def log_outage(self, service: str, exc: BaseException) -> None:
        """Log an outage of ``service`` (``PostgreSQL``, ``Redis``, ``Kafka``) at most once every
        :data:`OUTAGE_LOG_INTERVAL_S` per service (it can last minutes). Only for failures classified as an
        outage (:func:`streams.failures.classify`); anything else goes through :meth:`report_failure`."""
        now = time.monotonic()
        if now - self._last_outage_log.get(service, 0.0) >= OUTAGE_LOG_INTERVAL_S:
            self._last_outage_log[service] = now
            log.warning("%s unavailable, waiting: %s: %s", service, type(exc).__name__, exc)

    def report_failure(self, where: str, exc: BaseException) -> Failure:
        """Classify ``exc`` by type (:func:`streams.failures.classify`) and report it for the stage ``where``.

        * outage: counted in ``streams_outage_waits_total{service,where}``, logged by :meth:`log_outage`; the
          caller waits and tries again.
        * busy (this worker's own pool): counted in ``streams_redis_pool_busy_total``, logged at INFO.
        * anything else (a programming error, a refusal): logged at ERROR with its traceback and counted in
          ``streams_unexpected_errors_total{where}``; never reported as an outage.

        Returns the classification so the caller can decide (retry, bounded retry, raise).
        """
        failure = classify(exc)
        if failure.kind is FailureKind.OUTAGE:
            metrics.OUTAGE_WAITS.labels(failure.service, where).inc()
            self.log_outage(failure.service, exc)
        elif failure.kind is FailureKind.BUSY:
            metrics.REDIS_POOL_BUSY.labels(where).inc()
            log.info("%s: %s busy: %s", where, failure.service, exc)
        else:
            metrics.UNEXPECTED_ERRORS.labels(where).inc()
            log.error("%s failed unexpectedly (not an outage): %s: %s", where, type(exc).__name__, exc, exc_info=exc)
        return failure

    async def until_ledger(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` until it does not raise :class:`LedgerUnavailableError` (PostgreSQL restarts).

        Waits with capped exponential backoff and jitter (tenacity); gives up only after 10 minutes, raising
        the last :class:`LedgerUnavailableError`.
        """
        try:
            return await fn()  # the fast path: no retry machinery unless PostgreSQL is actually down
        except LedgerUnavailableError as exc:
            self._on_ledger_retry(what, exc)
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(LedgerUnavailableError),
            wait=tenacity.wait_exponential_jitter(multiplier=0.1, max=self.settings.coordination_retry_cap_s),
            stop=tenacity.stop_after_delay(600),
            reraise=True,
            before_sleep=lambda rs: self._on_ledger_retry(what, rs.outcome.exception() if rs.outcome else None),
        )
        async for attempt in retrying:
            with attempt:
                return await fn()
        raise AssertionError("unreachable")  # pragma: no cover

    def _on_ledger_retry(self, what: str, exc: BaseException | None) -> None:
        metrics.LEDGER_UNAVAILABLE.labels(what).inc()
        self.log_outage("PostgreSQL", exc if isinstance(exc, Exception) else Exception(what))

    async def acquire_waiting(self, key: str, action: str) -> Lease | None:
        """Try to take lease ``key``; while Redis is down, wait (no claim, no remote call) and retry.

        Returns the lease, or None when another owner holds it.
        """
        delay = 0.1
        while True:
            try:
                return await self.leases.acquire(key)
            except CoordinationUnavailableError as exc:
                metrics.COORDINATION_UNAVAILABLE.labels(action).inc()
                self.log_outage("Redis", exc)
                await asyncio.sleep(delay)
                delay = min(self.settings.coordination_retry_cap_s, delay * 2)

    async def publish(self, role: str, key: str, value: dict[str, Any]) -> None:
        """Send ``value`` as JSON (numbers exact) to the topic of ``role`` keyed by ``key``; returns once acked."""
        await self.send(self.settings.topic(role), key.encode(), exactjson.dumps(value))

    async def dead_letter(self, message: RawMessage, error: InvalidEventError) -> None:
        """Send ``message`` with its reason and original bytes to the dead-letter topic (waits for the ack)."""
        envelope = contracts.dead_letter(
            source_topic=message.topic,
            partition=message.partition,
            offset=message.offset,
            key=message.key,
            original=message.value,
            error=error,
            worker=self.worker,
        )
        metrics.DEAD_LETTERS.labels(message.topic, error.reason).inc()
        log.warning(
            "dead-lettered %s[%s]@%s: %s (%s)", message.topic, message.partition, message.offset, error.reason, error
        )
        key = (message.key or b"").decode("utf-8", "replace")
        delay = 0.2
        failed_attempts = 0
        while True:  # a dead letter is the event's only record: never drop it; wait out Kafka outages
            try:
                await self.publish("dead_letter", key, envelope)
                return
            except Exception as exc:
                failure = self.report_failure("dead letter", exc)
                if failure.kind is FailureKind.ERROR:
                    failed_attempts += 1
                    if failed_attempts >= DEAD_LETTER_ATTEMPTS:
                        raise DeadLetterError(
                            f"dead letter for {message.topic}[{message.partition}]@{message.offset} not published "
                            f"after {failed_attempts} attempts ({type(exc).__name__}: {exc}); the event is "
                            "neither processed nor recorded: fix the cause and consume it again"
                        ) from exc
                await asyncio.sleep(delay)
                delay = min(self.settings.coordination_retry_cap_s, delay * 2)

    async def account(
        self,
        operation_id: str,
        method: str,
        status_code: int | None,
        outcome: RemoteCallOutcome,
        remote_job_id: str | None,
        duration_ms: float,
        fencing_token: int | None,
    ) -> None:
        """Record one remote call in metrics and in the ledger's accounting (waits out PostgreSQL outages)."""
        metrics.REMOTE_CALLS.labels(method, outcome).inc()
        metrics.REMOTE_CALL_SECONDS.labels(method).observe(duration_ms / 1000.0)
        await self.until_ledger(
            f"account {method}",
            lambda: self.ledger.record_remote_call(
                operation_id, method, status_code, outcome, remote_job_id, duration_ms, fencing_token
            ),
        )
