"""A worker's shared resources and the waiting/retrying helpers the pipeline stages use.

One :class:`Runtime` per worker process: one asyncpg pool (the ledger), one Redis client and its coalescing
stage (leases and the account's rate budget, :mod:`streams.coordination.redisstage`), one ``httpx.AsyncClient`` (the
remote
API) and one Kafka producer (through a :data:`SendFn`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiokafka.errors
import asyncpg
import tenacity

from streams import metrics
from streams.bounded import CLOSE_TIMEOUT_S, close_within
from streams.config import Settings
from streams.coordination.lease import Lease, LeaseManager, redis_for
from streams.coordination.ratebudget import RateBudget
from streams.coordination.running import RunningSlots
from streams.errors import (
    CoordinationUnavailableError,
    DeadLetterError,
    InvalidEventError,
    LedgerUnavailableError,
    RecordNotHandedOverError,
    RemoteError,
    error_summary,
)
from streams.ledger.notices import NOTIFIED, TRANSITIONS, OutboxListener
from streams.ledger.pool import create_pool
from streams.ledger.protocol import PipelineLedger
from streams.ledger.records import RemoteCall
from streams.ledger.store import Ledger
from streams.ledger.waiting import OutageWait
from streams.model.answers import clean_text
from streams.model.codes import RemoteCallOutcome
from streams.outages import Failure, FailureKind, classify
from streams.remote.client import RemoteClient
from streams.retrying import failure_of, retry_without_deadline
from streams.wire import contracts, exactjson
from streams.worker.partitions import PartitionRoutes
from streams.worker.wakeup import WRITTEN, Wakeups

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Send one record and wait until Kafka acknowledged it: ``await send(topic, key, value)``.
SendFn = Callable[[str, bytes, bytes], Awaitable[Any]]

#: Hand one record to the producer's buffer and return at once with what completes when Kafka acknowledged it:
#: ``ack = await enqueue(topic, key, value); await ack`` (aiokafka's ``send``; records keep the order they were
#: handed over in, per partition).
EnqueueFn = Callable[[str, bytes, bytes], Awaitable[Awaitable[Any]]]

#: One record: ``(topic, key, value)``.
Record = tuple[str, bytes, bytes]

#: Attempts at publishing one dead letter when the failure is not an outage (e.g. the broker refuses the record
#: as too large): waiting cannot fix it, so after these the failure surfaces as :class:`DeadLetterError`.
#: Outages of Kafka are waited out without a limit (a dead letter is the event's only record).
DEAD_LETTER_ATTEMPTS = 3

#: Most characters of an error's text in one log line.
MAX_LOGGED_ERROR_CHARS = 500

#: Seconds between two log lines about the same ongoing outage.
OUTAGE_LOG_INTERVAL_S = 5.0

#: Longest a stopping worker spends announcing its transitions (s): the rest of its stop does not wait on an
#: unanswering PostgreSQL for this.
ANNOUNCE_TIMEOUT_S = 5.0

#: First wait (s) after Redis did not answer a lease acquisition or a rate budget request, and after a dead letter
#: was not published; each next wait doubles, up to ``Settings.coordination_retry_cap_s``.
REDIS_RETRY_FIRST_WAIT_S = 0.1
DEAD_LETTER_RETRY_FIRST_WAIT_S = 0.2


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
        ledger: PipelineLedger,
        leases: LeaseManager,
        remote: RemoteClient,
        send: SendFn,
        worker: str,
        enqueue: EnqueueFn | None = None,
        *,
        pool: asyncpg.Pool | None = None,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        #: The ledger's pool, for the live view's read-only queries (None with an in-memory ledger).
        self.pool = pool
        self.leases = leases
        self.remote = remote
        self.send = send
        self.enqueue = enqueue
        self.worker = worker
        # the provider account's rate budget, on the same Redis and through the same coalescing stage
        self.budget = RateBudget(leases.client, settings, stage=leases.stage, owner=worker)
        # the account's and models' running-job slots (the concurrency budget), likewise
        self.running = RunningSlots(leases.client, settings, stage=leases.stage)
        # the pipeline's statements wait out PostgreSQL outages inside the ledger, counted and logged here
        waiting = OutageWait(retry_cap_s=settings.coordination_retry_cap_s, on_retry=self._on_ledger_retry)
        ledger.wait_out_outages(waiting)
        # this worker's transitions notify no other worker (streams.ledger.written): its own relay publishes them
        ledger.on_transitions_written = self.transitions_written
        self._last_outage_log: dict[str, float] = {}
        #: True once :meth:`close` began: a failure of a client being closed is this worker stopping, no outage.
        self.closing = False
        #: What wakes the poll scheduler and the outbox relay (:mod:`streams.worker.wakeup`).
        self.wakeups = Wakeups()
        #: The ledger's LISTEN connection while :meth:`listen_outbox` runs, else None.
        self.outbox_listener: OutboxListener | None = None
        #: Which records' Kafka partitions are blocked (the outbox relay and the poll scheduler skip them); the
        #: worker gives it the producer's partitioner and its metadata watch's findings.
        self.routes = PartitionRoutes()

    @classmethod
    async def create(
        cls, settings: Settings, send: SendFn, worker: str | None = None, enqueue: EnqueueFn | None = None
    ) -> Runtime:
        """Connect to PostgreSQL and build the Redis and HTTP clients (Redis may still be down). ``enqueue``, when
        given, lets :meth:`send_all` hand many records over without a task each."""
        name = worker or worker_name()
        database_url = settings.database_url.get_secret_value()
        pool = await create_pool(
            database_url,
            min_size=2,
            max_size=settings.db_pool_max_size,
            idle_lifetime_s=settings.db_pool_idle_lifetime_s,
            statement_cache_size=settings.database_statement_cache_size,
            worker=True,
        )
        redis = redis_for(
            settings,
            settings.redis_socket_timeout_s,
            connect_timeout_s=settings.redis_connect_timeout_s,
            max_connections=settings.redis_max_connections,
            pool_timeout_s=settings.redis_pool_timeout_s,
        )
        remote = RemoteClient.from_settings(settings)
        leases = LeaseManager.from_settings(redis, settings)
        return cls(settings, Ledger(pool, name), leases, remote, send, name, enqueue, pool=pool)

    def ledger_pool(self) -> asyncpg.Pool:
        """The ledger's pool for read-only queries (the live view, the snapshot, the readiness probe).

        Raises:
            LedgerUnavailableError: this runtime has none (an in-memory ledger).
        """
        if self.pool is None:
            raise LedgerUnavailableError("this runtime has no PostgreSQL pool (an in-memory ledger)")
        return self.pool

    async def listen_outbox(self) -> None:
        """Wake the outbox relay on every worker's committed outbox rows (:class:`OutboxListener`, one dedicated
        connection) until cancelled; returns at once with an in-memory ledger or ``outbox_listen_enabled`` off."""
        if self.pool is None or not self.settings.outbox_listen_enabled:
            return
        self.outbox_listener = OutboxListener(
            self.settings.database_url.get_secret_value(),
            self._on_outbox_notice,
            retry_cap_s=self.settings.coordination_retry_cap_s,
        )
        await self.outbox_listener.run()

    def _on_outbox_notice(self, cause: str) -> None:
        """Wake the relay for a notice of the listener: committed outputs within ``wakeup_peer_outputs_delay_s``
        (or ``wakeup_fallback_s`` if shorter), times 0.5-1 so that the relays notified together do not all meet at
        the relay lock (their writer's relay, woken in-process, publishes them at once, so this round is the
        back-up, one for every output of that span), transitions alone within
        ``wakeup_fallback_s`` (every transition of that span in one round), a (re)connection or a lost connection
        at once."""
        if cause == TRANSITIONS:
            self.wakeups.outbox.due_in(self.settings.wakeup_fallback_s)
        elif cause == NOTIFIED:
            delay_s = min(self.settings.wakeup_peer_outputs_delay_s, self.settings.wakeup_fallback_s)
            self.wakeups.outbox.due_in(delay_s * random.uniform(0.5, 1.0), NOTIFIED)  # relays woken apart
        else:
            self.wakeups.outbox.notify(cause)

    def transitions_written(self) -> None:
        """Wake the relay within ``wakeup_fallback_s`` for transitions this worker wrote (``written``; every
        transition of that span in one round): the outbox trigger notifies no worker of them
        (migrations/0019.worker-transitions.sql)."""
        self.wakeups.outbox.due_in(self.settings.wakeup_fallback_s, WRITTEN)

    def outbox_fallback_s(self) -> float:
        """Longest the outbox relay sleeps without a wake-up now (s): ``wakeup_listening_fallback_s`` while the
        outbox listener is connected (every committed row notifies it, or is this worker's own and wakes it through
        :meth:`transitions_written`), else ``wakeup_fallback_s``."""
        listener = self.outbox_listener
        if listener is not None and listener.listening:
            return self.settings.wakeup_listening_fallback_s
        return self.settings.wakeup_fallback_s

    async def close(self) -> None:
        """Close all clients; before the ledger's pool, announce this worker's transitions (at most
        :data:`ANNOUNCE_TIMEOUT_S`; a failure is logged, never raised). Call it after the loops that write the
        ledger stopped (streams.worker.app ``close_runtime``)."""
        self.closing = True
        await close_within(self.remote.aclose(), CLOSE_TIMEOUT_S, "the provider's HTTP client")
        await self.leases.stage.drain()  # lease releases still queued or on the wire
        await self.leases.client.aclose()
        try:  # after this worker's last write: other workers' relays publish what its relay left
            async with asyncio.timeout(ANNOUNCE_TIMEOUT_S):
                await self.ledger.announce_transitions()
        except Exception as exc:  # an outage, a timeout or a bug: the rows wait for another relay's round
            log.warning(
                "could not announce this worker's transitions; their outbox rows wait for another worker's relay "
                "(at most STREAMS_WAKEUP_LISTENING_FALLBACK_S): %s",
                error_summary(exc),
            )
        finally:
            await self.ledger.close()

    def log_outage(self, service: str, exc: BaseException) -> None:
        """Log an outage of ``service`` (``PostgreSQL``, ``Redis``, ``Kafka``) at most once every
        :data:`OUTAGE_LOG_INTERVAL_S` per service (it can last minutes). Only for failures classified as an
        outage (:func:`streams.outages.classify`); anything else goes through :meth:`report_failure`."""
        if self.closing:  # e.g. "pool is closed" from a timer still running while the worker stops
            log.debug("%s closed while this worker stops: %s", service, error_summary(exc))
            return
        now = time.monotonic()
        if now - self._last_outage_log.get(service, 0.0) >= OUTAGE_LOG_INTERVAL_S:
            self._last_outage_log[service] = now
            log.warning("%s unavailable, waiting: %s", service, error_summary(exc))

    def report_failure(self, where: str, exc: BaseException) -> Failure:
        """Classify ``exc`` by type (:func:`streams.outages.classify`) and report it for the stage ``where``.

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
            log.error("%s failed unexpectedly (not an outage): %s", where, error_summary(exc), exc_info=exc)
        return failure

    def _on_ledger_retry(self, what: str, exc: BaseException) -> None:
        metrics.LEDGER_UNAVAILABLE.labels(what).inc()
        self.log_outage("PostgreSQL", exc if isinstance(exc, Exception) else Exception(what))

    async def acquire_waiting(self, key: str, action: str) -> Lease | None:
        """Try to take lease ``key``; while Redis is down, wait (no claim, no remote call) and retry, without a
        deadline: every failed attempt is counted in ``streams_coordination_unavailable_total{action}`` and
        logged (:meth:`log_outage`), then waited after (tenacity: 0.1 s doubling, at most
        ``coordination_retry_cap_s``). Any other exception is raised at once.

        Returns the lease, or None when another owner holds it.
        """
        return await retry_without_deadline(  # a plain first attempt: no retry machinery while Redis answers
            lambda: self.leases.acquire(key),
            retry_on=CoordinationUnavailableError,
            wait=self.redis_retry_wait,
            on_retry=lambda exc: self._on_redis_retry(action, exc),
        )

    def redis_retry_wait(self, retry_state: tenacity.RetryCallState) -> float:
        """A tenacity wait (seconds) after a Redis call failed for lack of Redis or of a pooled connection:
        :data:`REDIS_RETRY_FIRST_WAIT_S` doubling with each failure, at most ``coordination_retry_cap_s``."""
        cap_s = self.settings.coordination_retry_cap_s
        return float(tenacity.wait_exponential(multiplier=REDIS_RETRY_FIRST_WAIT_S, max=cap_s)(retry_state))

    def _on_redis_retry(self, action: str, exc: BaseException) -> None:
        metrics.COORDINATION_UNAVAILABLE.labels(action).inc()
        self.log_outage("Redis", exc)

    async def send_all(self, records: Sequence[Record]) -> list[BaseException | None]:
        """Send ``records`` and wait until Kafka acknowledged (or refused) each; returns, per record in order, None
        (acknowledged) or the exception that record met. Never raises but for cancellation.

        With an ``enqueue`` (the worker's producer) every record is handed to the producer's buffer in order, then
        their acknowledgements are awaited together: no task per record. Without one, :attr:`send` runs for each
        record concurrently."""
        return [delivery_error(delivery) for delivery in await self.send_within(records, None)]

    async def send_within(self, records: Sequence[Record], wait_s: float | None) -> list[asyncio.Future[Any]]:
        """Send ``records`` as :meth:`send_all` does, but wait at most ``wait_s`` seconds (None: until every one is
        done) for their acknowledgements; returns, per record in order, its delivery: a future done with the
        acknowledgement or the exception that record met (:func:`delivery_error`), or still pending while Kafka
        has not answered. A pending record is in flight: the producer acknowledges or fails it within
        ``kafka_delivery_timeout_s``, so sending it again before that may write it twice. The hand-over to the
        producer is bounded by the same wait (:meth:`_hand_over`). Never raises but for cancellation (which leaves
        the records in flight)."""
        loop = asyncio.get_running_loop()
        deadline = None if wait_s is None else loop.time() + wait_s
        if self.enqueue is None:
            deliveries: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.send(*record)) for record in records]
        else:
            deliveries = await self._hand_over(records, wait_s)
        for delivery in deliveries:  # a late failure nobody awaits is no "exception never retrieved"
            delivery.add_done_callback(delivery_error)
        pending = [delivery for delivery in deliveries if not delivery.done()]
        if pending and (deadline is None or deadline > loop.time()):
            await asyncio.wait(pending, timeout=None if deadline is None else deadline - loop.time())
        return deliveries

    async def _hand_over(self, records: Sequence[Record], wait_s: float | None) -> list[asyncio.Future[Any]]:
        """Hand ``records`` to the producer's buffer in order (:attr:`enqueue`), within ``wait_s`` seconds (None: no
        bound); returns their deliveries. The producer makes a hand-over wait while the batch of the record's
        partition is full and not yet sent (a partition that does not acknowledge): at the bound that record gets
        aiokafka's ``KafkaTimeoutError`` (an outage: its partition is skipped) and the records after it
        :class:`RecordNotHandedOverError`; neither was sent."""
        loop = asyncio.get_running_loop()
        deliveries: list[asyncio.Future[Any]] = []

        def failed(exc: BaseException) -> asyncio.Future[Any]:
            future: asyncio.Future[Any] = loop.create_future()
            future.set_exception(exc)
            return future

        async def hand_over() -> None:
            assert self.enqueue is not None
            for record in records:
                try:
                    deliveries.append(asyncio.ensure_future(await self.enqueue(*record)))
                except Exception as exc:  # not even buffered (no metadata for the topic, a record too large, ...)
                    deliveries.append(failed(exc))

        handing = asyncio.ensure_future(hand_over())
        try:
            done, _ = await asyncio.wait([handing], timeout=wait_s)
        except asyncio.CancelledError:
            handing.cancel()
            raise
        if not done:  # cancelled inside the producer's wait for a full batch: that record was not buffered
            handing.cancel()
            await asyncio.wait([handing])
            if len(deliveries) < len(records):
                deliveries.append(failed(aiokafka.errors.KafkaTimeoutError()))
            waited = f"{wait_s} s (STREAMS_KAFKA_ROUND_ACK_WAIT_S)"
            while len(deliveries) < len(records):
                deliveries.append(
                    failed(
                        RecordNotHandedOverError(
                            f"Kafka record not handed to the producer within {waited}: an earlier record waited on "
                            "a partition that does not acknowledge; sent again by a later round"
                        )
                    )
                )
        else:
            handing.result()  # only a BaseException (not caught above) is raised here
        return deliveries

    async def publish(self, role: str, key: str, value: dict[str, Any]) -> None:
        """Send ``value`` as JSON (numbers exact) to the topic of ``role`` keyed by ``key``; returns once acked."""
        await self.send(self.settings.topic(role), key.encode(), exactjson.dumps(value))

    async def dead_letter(self, message: RawMessage, error: InvalidEventError) -> None:
        """Send ``message`` with its reason and original bytes to the dead-letter topic (waits for the ack); once
        acknowledged, count it (``streams_dead_letters_total``) and log it."""
        envelope = contracts.dead_letter(
            source_topic=message.topic,
            partition=message.partition,
            offset=message.offset,
            key=message.key,
            original=message.value,
            error=error,
            worker=self.worker,
        )
        key = (message.key or b"").decode("utf-8", "replace")
        # A dead letter is the event's only record: never drop it. Every failed attempt is reported
        # (:meth:`report_failure`) and waited after (tenacity: 0.2 s doubling, at most coordination_retry_cap_s);
        # outages are waited out without a limit, other failures end it at the DEAD_LETTER_ATTEMPTS-th.
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(Exception),
            after=self._on_dead_letter_failure,
            wait=tenacity.wait_exponential(
                multiplier=DEAD_LETTER_RETRY_FIRST_WAIT_S, max=self.settings.coordination_retry_cap_s
            ),
            stop=_StopAfterErrors(DEAD_LETTER_ATTEMPTS),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await self.publish("dead_letter", key, envelope)
        except Exception as exc:  # only a failure that is not an outage stops the retrying
            raise DeadLetterError(
                f"dead letter for {message.topic}[{message.partition}]@{message.offset} not published "
                f"after {DEAD_LETTER_ATTEMPTS} attempts ({error_summary(exc)}); the event is "
                "neither processed nor recorded: fix the cause and consume it again"
            ) from exc
        metrics.DEAD_LETTERS.labels(message.topic, error.reason).inc()
        # the value's size and digest, never the value: the error's text names fields and kinds, not content
        # (streams.wire.contracts.explain), and is cut to a bounded length all the same
        log.warning(
            "dead-lettered %s[%s]@%s: %s, %d bytes, sha256 %s: %s",
            message.topic,
            message.partition,
            message.offset,
            error.reason,
            envelope["original_size"],
            envelope["original_sha256"],
            clean_text(str(error), MAX_LOGGED_ERROR_CHARS),
        )

    def _on_dead_letter_failure(self, retry_state: tenacity.RetryCallState) -> None:
        self.report_failure("dead letter", failure_of(retry_state) or Exception("dead letter"))

    async def account(self, call: RemoteCall) -> None:
        """Record one remote call in metrics (:meth:`count_call`) and in the ledger's accounting (waits out
        PostgreSQL outages; the record's ``call_id`` stays the same through the repeats, so it is one row)."""
        self.count_call(call)
        await self.ledger.record_remote_call(call)

    def count_call(self, call: RemoteCall) -> None:
        """Count one remote call in the metrics (calls by method and outcome, duration); its ledger record is
        written by the save it comes with, or :meth:`account`'s ``record_remote_call``, never both."""
        metrics.REMOTE_CALLS.labels(call.method, call.outcome).inc()
        metrics.REMOTE_CALL_SECONDS.labels(call.method).observe(call.duration_ms / 1000.0)

    async def account_failure(
        self,
        operation_id: str,
        method: str,
        exc: RemoteError,
        started: float,
        remote_job_id: str | None,
        fencing_token: int | None,
        outcome: RemoteCallOutcome | None = None,
    ) -> None:
        """Record (:meth:`account`) one remote call that raised ``exc``: its status code, its outcome (``outcome``,
        default ``exc.outcome``) and its duration from ``started`` (a ``time.perf_counter()`` reading) to now."""
        duration_ms = (time.perf_counter() - started) * 1000.0
        outcome = exc.outcome if outcome is None else outcome
        await self.account(
            RemoteCall(operation_id, method, exc.status_code, outcome, remote_job_id, duration_ms, fencing_token)
        )


def delivery_error(delivery: asyncio.Future[Any]) -> BaseException | None:
    """What a done delivery of :meth:`Runtime.send_within` met: None (acknowledged) or its exception (a
    ``CancelledError`` when it was cancelled)."""
    if delivery.cancelled():
        return asyncio.CancelledError()
    return delivery.exception()


class _StopAfterErrors(tenacity.stop.stop_base):
    """Stop retrying at the ``limit``-th failure classified :attr:`FailureKind.ERROR` (a refusal or a bug that
    waiting cannot fix); outages and busy pools never stop it. One instance per retried call (it counts)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.errors = 0

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        failure = failure_of(retry_state)
        if failure is not None and classify(failure).kind is FailureKind.ERROR:
            self.errors += 1
        return self.errors >= self.limit
