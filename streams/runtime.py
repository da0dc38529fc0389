"""A worker's shared resources and the waiting/retrying helpers the pipeline stages use.

One :class:`Runtime` per worker process: one asyncpg pool (the ledger), one Redis client (leases), one
``httpx.AsyncClient`` (the remote API) and one Kafka producer (through a :data:`SendFn`).
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
from streams.config import Settings
from streams.errors import CoordinationUnavailableError, InvalidEventError, LedgerUnavailableError
from streams.lease import Lease, LeaseManager, make_redis
from streams.ledger import Ledger, create_pool
from streams.remote import RemoteClient, make_http_client

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Send one record and wait until Kafka acknowledged it: ``await send(topic, key, value)``.
SendFn = Callable[[str, bytes, bytes], Awaitable[Any]]


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
        self._last_outage_log: dict[str, float] = {}

    @classmethod
    async def create(cls, settings: Settings, send: SendFn, worker: str | None = None) -> Runtime:
        """Connect to PostgreSQL and build the Redis and HTTP clients (Redis may still be down)."""
        name = worker or worker_name()
        database_url = settings.database_url.get_secret_value()
        pool = await create_pool(database_url, min_size=2, max_size=settings.db_pool_max_size)
        redis = make_redis(settings.redis_url.get_secret_value(), settings.redis_socket_timeout_s)
        remote = RemoteClient(make_http_client(settings), settings.remote_model)
        return cls(settings, Ledger(pool, name), LeaseManager(redis, settings.lease_ttl_ms), remote, send, name)

    async def close(self) -> None:
        """Close all clients."""
        await self.remote.aclose()
        await self.leases.client.aclose()
        await self.ledger.close()

    def log_outage(self, what: str, exc: Exception) -> None:
        """Log an outage at most once every 5 s per kind (it can last minutes)."""
        now = time.monotonic()
        if now - self._last_outage_log.get(what, 0.0) >= 5.0:
            self._last_outage_log[what] = now
            log.warning("%s unavailable, waiting: %s", what, exc)

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
        while True:  # a dead letter is the event's only record: never drop it, wait for Kafka instead
            try:
                await self.publish("dead_letter", key, envelope)
                return
            except Exception as exc:
                self.log_outage("dead-letter topic", exc)
                await asyncio.sleep(delay)
                delay = min(self.settings.coordination_retry_cap_s, delay * 2)

    async def account(
        self,
        operation_id: str,
        method: str,
        status_code: int | None,
        outcome: str,
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
