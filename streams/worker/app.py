"""The Faust application: topics, agents, timers and web views of one worker process.

Layout (faust-streaming user guide, "medium/large projects"): the pipeline logic lives in plain classes
(:mod:`streams.worker.stages.dispatcher`, :mod:`streams.worker.stages.observer`,
:mod:`streams.worker.stages.scheduler`, :mod:`streams.worker.stages.relay`); this
module only wires them to Kafka.

* ``dispatch`` agent: ``generation.submissions`` -> :class:`~streams.worker.stages.dispatcher.Dispatcher`.
* ``observe`` agent: ``generation.polls`` -> :class:`~streams.worker.stages.observer.Observer`; a job's first poll
  with a short hint is taken in the dispatching worker instead (:class:`~streams.worker.stages.firstpoll.FirstPolls`,
  in the same slots).
* ``cancel`` agent: ``generation.cancellations`` -> :class:`~streams.worker.stages.canceller.Canceller`
  (docs/cancellation.md).
* ``schedule_polls`` task: :class:`~streams.worker.stages.scheduler.PollScheduler` (due polls, reconciliation,
  re-dispatch of forgotten ``accepted`` operations), woken when the next poll is due (:mod:`streams.worker.wakeup`).
* ``relay_outbox`` task: :class:`~streams.worker.stages.relay.OutboxRelay`, woken by committed outbox rows.
* ``listen_outbox`` task (with ``outbox_listen_enabled``): the ledger's LISTEN connection
  (:class:`~streams.ledger.notices.OutboxListener`), waking the relay on any worker's outbox rows.
* ``reconcile_lookups`` task (only with ``lookup_enabled``): :class:`~streams.worker.stages.reconciler.Reconciler`, in
a loop
  of its own, so a slow lookup never delays poll scheduling.
* ``check_clock`` task: :class:`~streams.worker.clock.ClockCheck` at start and every ``clock_check_interval_s``:
  this worker's wall clock against PostgreSQL's (``streams_clock_skew_seconds``, a WARNING past
  ``clock_skew_warn_s``).
* ``take_snapshots`` task (with ``web_enabled``): :class:`~streams.oncall.snapshot.Snapshotter` every
  ``web_snapshot_interval_s``: the gauges of ``/metrics`` and the live view's figures.
* Web (``web_bind``:``web_port``): ``GET /metrics`` (Prometheus text), the probes ``GET /livez`` and ``GET /readyz``
  (``/healthz``: the same as ``/readyz``), and the live view (:mod:`streams.oncall.liveview`); access and headers
  by :mod:`streams.oncall.webaccess`, connections bounded by :mod:`streams.oncall.webserver`
  (``web_max_connections``, ``web_header_timeout_s``). Faust's own pages are off. With ``callbacks_enabled``: ``POST
  <callback_path>``, the provider's completion callbacks (:mod:`streams.worker.stages.callbacks`, signed, not behind
  the web credentials), which wake the ``schedule_polls`` task.

Offsets (see :mod:`streams.worker.inflight`): each agent has one actor per worker, reading a ``noack`` stream, so
faust never acknowledges an event by itself (a plain stream acknowledges the event it yielded when the actor
moves on, raises or is cancelled; ``take()`` acknowledges its whole batch in a ``finally``). Each event is
handled in its own task, up to ``dispatcher_concurrency`` / ``observer_concurrency`` at once, and
acknowledged only when it and every earlier event of its partition are handled: the committed offset never
passes an event whose handling has not finished, and a worker killed at any moment leaves its unfinished
events to the next owner of the partition. Behind an event that stays in flight, later events are still
handled (their acknowledgements wait), up to :data:`UNACKED_PER_SLOT` per slot; then intake pauses.

An unexpected exception while handling an event never stops the partition: the event is retried
(:data:`HANDLER_ATTEMPTS`), then goes to the dead-letter topic with reason ``processing_error`` and its
original bytes, so it can be replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast

import faust
import tenacity
from aiohttp import web
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as FaustKafkaConsumer
from faust.transport.drivers.aiokafka import Producer as FaustKafkaProducer
from faust.web.drivers.aiohttp import Web as FaustAiohttpWeb
from prometheus_client import generate_latest

from streams import logs, metrics
from streams.bounded import CLOSE_TIMEOUT_S, answer_within
from streams.config import Settings
from streams.errors import InvalidEventError, LedgerUnavailableError, error_summary
from streams.kafka_security import faust_settings, keep_delivery_timeout
from streams.ledger.snapshot import ping as ping_ledger
from streams.model.answers import clean_text
from streams.oncall import webaccess
from streams.oncall.liveview import register_pages
from streams.oncall.snapshot import Snapshot, Snapshotter
from streams.oncall.webserver import CappedRunner
from streams.outages import classify, is_outage
from streams.retrying import failure_of, first_attempt_plain
from streams.worker.clock import ClockCheck
from streams.worker.inflight import InOrderAcks, Ticket
from streams.worker.partitions import (
    BLOCKED_CHECK_INTERVAL_S,
    BlockedPartitions,
    blocked_partitions,
    producer_partition,
)
from streams.worker.runtime import MAX_LOGGED_ERROR_CHARS, RawMessage, Runtime
from streams.worker.stages.callbacks import CallbackReceiver
from streams.worker.stages.canceller import Canceller
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.firstpoll import FirstPolls
from streams.worker.stages.observer import Observer
from streams.worker.stages.reconciler import Reconciler
from streams.worker.stages.relay import OutboxRelay
from streams.worker.stages.scheduler import PollScheduler

log = logging.getLogger(__name__)


#: Attempts at an event whose handling raised unexpectedly, before it is dead-lettered (handlers are
#: idempotent, so a retry is safe; outages of PostgreSQL and Redis are waited out inside the handlers).
HANDLER_ATTEMPTS = 5

#: Pause of the reconciler's loop when no lookup was due (s).
RECONCILER_IDLE_S = 1.0

#: Pause between attempts to connect the worker's clients while PostgreSQL is unavailable at start (s).
RUNTIME_RETRY_S = 2.0

#: Events received and not yet acknowledged, per handling slot, before an agent stops taking new ones. Behind
#: an event that stays in flight the later ones are handled but cannot be acknowledged; this bounds the memory
#: they hold and what the next owner of the partition reads again after a crash.
UNACKED_PER_SLOT = 16

#: Cancellation events a worker handles at once (each is one ledger statement; cancellations are rare).
CANCEL_CONCURRENCY = 4


async def handle_with_retries(rt: Runtime, handle: Callable[[RawMessage], Awaitable[None]], raw: RawMessage) -> None:
    """Run ``handle(raw)``; retry unexpected errors with backoff, then dead-letter the event with reason
    ``processing_error`` and its original bytes (it can be replayed from there). Never raises.

    Every failed attempt is counted in ``streams_handler_failures_total{topic,kind,then}`` (``kind`` the
    failure's class, :func:`streams.outages.classify`; ``then`` ``retried`` or ``dead_lettered``) and logged
    (:class:`HandlerFailureLog`: at most once per topic, key and exception type every
    :data:`HANDLER_FAILURE_LOG_INTERVAL_S`; the last attempt always, with its traceback). The retry policy is
    built only after a first attempt failed (:func:`streams.retrying.first_attempt_plain`): tenacity costs about
    30 µs per event otherwise."""

    async def attempt() -> None:
        logs.clear()  # log lines carry this event's operation fields only (streams.logs)
        await handle(raw)

    try:
        await first_attempt_plain(attempt, lambda: _handler_retrying(raw))
    except Exception as exc:
        kind = classify(exc).kind
        metrics.HANDLER_FAILURES.labels(raw.topic, kind, "dead_lettered").inc()
        log.error(
            "handling %s[%s]@%s failed %d times (%s, last: %s); dead-lettering it",
            raw.topic,
            raw.partition,
            raw.offset,
            HANDLER_ATTEMPTS,
            kind,
            type(exc).__name__,
            exc_info=exc,
        )
        message = clean_text(error_summary(exc), MAX_LOGGED_ERROR_CHARS)
        await rt.dead_letter(raw, InvalidEventError("processing_error", message))


#: Seconds between two log lines about failed attempts at events of one topic and key with one exception type.
HANDLER_FAILURE_LOG_INTERVAL_S = 10.0


class HandlerFailureLog:
    """Logs a retried failure of a handler at most once per (topic, key, exception type) every ``interval_s``,
    saying how many were held back since; keeps at most ``max_keys`` keys (the oldest are forgotten)."""

    def __init__(
        self,
        interval_s: float = HANDLER_FAILURE_LOG_INTERVAL_S,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.clock = clock
        #: (topic, key, exception type) -> (when last logged, attempts held back since).
        self._last: dict[tuple[str, bytes, str], tuple[float, int]] = {}

    def failed(self, raw: RawMessage, exc: BaseException, attempt: int) -> bool:
        """Count and maybe log attempt ``attempt`` at ``raw`` that raised ``exc`` (it is retried). True when
        logged."""
        kind = classify(exc).kind
        metrics.HANDLER_FAILURES.labels(raw.topic, kind, "retried").inc()
        key = (raw.topic, raw.key or b"", type(exc).__name__)
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._last[key] = (last[0], last[1] + 1)
            return False
        if last is None and len(self._last) >= self.max_keys:
            self._last.pop(next(iter(self._last)))
        self._last[key] = (now, 0)
        held = f" [{last[1]} more like it held back]" if last is not None and last[1] else ""
        log.warning(
            "handling %s[%s]@%s failed (attempt %d of %d, %s): %s; retrying%s",
            raw.topic,
            raw.partition,
            raw.offset,
            attempt,
            HANDLER_ATTEMPTS,
            kind,
            clean_text(error_summary(exc), MAX_LOGGED_ERROR_CHARS),
            held,
        )
        return True


#: The failure log of this process's handlers.
HANDLER_FAILURE_LOG = HandlerFailureLog()


def _handler_retrying(raw: RawMessage) -> tenacity.AsyncRetrying:
    def report(state: tenacity.RetryCallState) -> None:
        failure = failure_of(state)
        if failure is not None:
            HANDLER_FAILURE_LOG.failed(raw, failure, state.attempt_number)

    return tenacity.AsyncRetrying(
        stop=tenacity.stop_after_attempt(HANDLER_ATTEMPTS),
        wait=tenacity.wait_exponential_jitter(multiplier=0.2, max=5.0),
        before_sleep=report,
        reraise=True,
    )


class Intake:
    """The in-flight state of one agent in this worker; it outlives a restart of the agent's actor.

    Args:
        concurrency: events handled at once (``dispatcher_concurrency`` / ``observer_concurrency``).
        generation: the consumer group generation now (``app.consumer_generation_id``).
    """

    def __init__(self, concurrency: int, generation: Callable[[], int]) -> None:
        self.generation = generation
        self.acks: InOrderAcks[Any] = InOrderAcks()
        self.slots = asyncio.Semaphore(concurrency)
        self.unacked = asyncio.Semaphore(concurrency * UNACKED_PER_SLOT)
        self.tasks: set[asyncio.Task[None]] = set()

    async def reserve(self) -> None:
        """Wait for room for one more event: a handling slot and an unacknowledged place."""
        await self.unacked.acquire()
        try:
            await self.slots.acquire()
        except BaseException:
            self.unacked.release()
            raise

    def unreserve(self) -> None:
        """Give back a reservation that received no event."""
        self.slots.release()
        self.unacked.release()

    async def run(self, ticket: Ticket[Any], handle: Callable[[RawMessage], Awaitable[None]], rt: Runtime) -> None:
        """Handle one event; once handled, acknowledge every event this releases (in offset order).

        A cancelled handling (the worker stopping) acknowledges nothing: its event is read again by the next
        owner of the partition, and so is every later event of the partition. An event received before the
        latest rebalance is not acknowledged either (rebalances wait for events in flight, so this only
        happens when that wait was cut short): its partition was sought back to the committed offset, which
        such a late acknowledgement could otherwise carry past events read again and not yet handled.
        """
        m = ticket.event.message
        try:
            await handle_with_retries(rt, handle, RawMessage(m.topic, m.partition, m.offset, m.key, m.value))
        finally:
            self.slots.release()
        for event in self.acks.finish(ticket):
            if event.message.generation_id == self.generation():
                event.ack()
            self.unacked.release()

    async def consume(self, stream: Any, handle: Callable[[RawMessage], Awaitable[None]], rt: Runtime) -> None:
        """Read ``stream`` without faust's acknowledgements; start a task per event as room allows."""
        events = stream.noack().events().__aiter__()
        while True:
            await self.reserve()
            try:
                event = await events.__anext__()
            except StopAsyncIteration:
                self.unreserve()
                return
            except BaseException:
                self.unreserve()
                raise
            # No await between receiving the event and tracking it: a cancellation cannot lose it here.
            ticket = self.acks.track(event.message.tp, event)
            task = asyncio.create_task(self.run(ticket, handle, rt))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)


def faust_data_dir(app_id: str) -> Path:
    """Faust's data directory for the app ``app_id``: ``<temp dir>/<app id>-data`` (nothing is kept in it)."""
    return Path(tempfile.gettempdir()) / f"{app_id}-data"


class _IdempotentProducer(FaustKafkaProducer):
    """Faust's aiokafka producer, idempotent with ``acks=all`` outside transactions too (Faust sets both only
    in a transaction): a retried batch is never written twice, nor out of order."""

    def _settings_extra(self) -> Mapping[str, Any]:
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}

    def _new_producer(self, transactional_id: str | None = None) -> Any:
        delivery_timeout_s = cast(_App, self.app).kafka_delivery_timeout_s
        return keep_delivery_timeout(super()._new_producer(transactional_id), delivery_timeout_s)


#: The most an idle worker's aiokafka fetcher waits before it looks at its partitions again (aiokafka's
#: ``consumer_timeout_ms``, 200 ms by default, which Faust does not set): as long as the fetch requests Faust makes
#: wait at the broker for data (its ``fetch_max_wait_ms``, 1,500 ms). The fetcher wakes at once for what it acts on
#: (``aiokafka/consumer/fetcher.py``, ``_fetch_requests_routine``): a fetch or offset reset that ends (data, an error,
#: a leader change), buffered records consumed, a seek, a new assignment, a partition aiokafka resumes, and a
#: metadata update when a partition has no leader; this bound only paces its idle rounds, five a second by default.
FETCHER_IDLE_WAKEUP_S = 1.5


class _QuietFetcherThread(AIOKafkaConsumerThread):
    """Faust's thread around the aiokafka consumer, whose fetcher waits :data:`FETCHER_IDLE_WAKEUP_S` between idle
    rounds."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # Read by AIOKafkaConsumer.start() when it makes its Fetcher (fetcher_timeout); not a constructor argument
        # Faust passes. tests/integration/test_worker_fetcher.py checks the started fetcher's value.
        if hasattr(consumer, "_consumer_timeout"):
            consumer._consumer_timeout = FETCHER_IDLE_WAKEUP_S
        else:  # an aiokafka that keeps it elsewhere: its own default stays, only idle CPU differs
            log.warning("aiokafka's consumer has no _consumer_timeout: its fetcher keeps its own idle pace")
        return consumer


class _SeekingConsumer(FaustKafkaConsumer):
    """Faust's aiokafka consumer (its thread a :class:`_QuietFetcherThread`); a partition without a committed offset
    is sought back to its beginning too.

    Faust drops the records it fetched while a rebalance suspended its flow (or a generation changed within a
    fetch), trusting ``seek_to_committed`` to read them again; aiokafka's seeks only to a committed offset above
    0 (``if offset and offset > 0``, ``aiokafka/consumer/consumer.py`` ``seek_to_committed``), so on a partition
    nothing was committed on yet (one grown live) those records were skipped for good. Offset 0 is where the
    consumer's reset policy (``earliest``) starts such a partition anyway; the ledger accepts a record read twice
    once. On a partition whose head retention deleted (log start above 0), the broker answers the fetch at 0 with
    OffsetOutOfRange and aiokafka resets to the log start by that same policy: nothing still in the log is
    skipped (tests/integration/test_seek_below_log_start.py)."""

    def _new_consumer_thread(self) -> AIOKafkaConsumerThread:
        return _QuietFetcherThread(self, loop=self.loop, beacon=self.beacon)

    async def seek_to_committed(self) -> Mapping[Any, int]:
        committed = await super().seek_to_committed()
        unsought = {tp: 0 for tp, offset in committed.items() if not offset}
        if unsought:
            await self.seek_wait(unsought)
        return committed


class _CappedWeb(FaustAiohttpWeb):
    """Faust's aiohttp web driver, served by a :class:`~streams.oncall.webserver.CappedRunner`: at most
    ``max_connections`` connections, each with ``header_timeout_s`` to send a request's headers."""

    def __init__(self, app: Any, *, max_connections: int, header_timeout_s: float) -> None:
        super().__init__(app)
        self._runner = CappedRunner(self.web_app, max_connections, header_timeout_s)


class _App(faust.App):
    """The worker's Faust app: its producer is :class:`_IdempotentProducer`, its consumer
    :class:`_SeekingConsumer`, its web driver :class:`_CappedWeb` (``web_max_connections``,
    ``web_header_timeout_s``); ``kafka_delivery_timeout_s`` is its producer's batches' time to live (Faust's
    ``producer_request_timeout`` is each request's timeout, :func:`streams.kafka_security.keep_delivery_timeout`)."""

    def __init__(
        self,
        *args: Any,
        web_max_connections: int,
        web_header_timeout_s: float,
        kafka_delivery_timeout_s: float,
        **kwargs: Any,
    ) -> None:
        self.web_bounds = (web_max_connections, web_header_timeout_s)
        self.kafka_delivery_timeout_s = kafka_delivery_timeout_s
        super().__init__(*args, **kwargs)

    def _new_web(self) -> Any:
        max_connections, header_timeout_s = self.web_bounds
        return _CappedWeb(self, max_connections=max_connections, header_timeout_s=header_timeout_s)

    def _new_producer(self) -> Any:
        return _IdempotentProducer(self.transport, loop=self.loop, beacon=self.beacon)

    def _new_consumer(self) -> Any:
        return _SeekingConsumer(
            self.transport,
            callback=self.topics.on_message,
            loop=self.transport.loop,
            on_partitions_revoked=self._on_partitions_revoked,
            on_partitions_assigned=self._on_partitions_assigned,
            beacon=self.beacon,
        )


async def run_forever(tick: Callable[[], Awaitable[int]], idle_s: float, wake: asyncio.Event | None = None) -> None:
    """Run ``tick`` back to back while it finds work, waiting ``idle_s`` when it finds none, or until ``wake`` is
    set (cleared before each tick, so a wake-up during a tick runs the next one at once). Never returns; a tick's
    exception is logged and waited out like an idle round."""
    while True:
        if wake is not None:
            wake.clear()
        try:
            busy = await tick()
        except Exception:
            log.exception("periodic task failed; retrying")
            busy = 0
        if not busy:
            if wake is None:
                await asyncio.sleep(idle_s)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(idle_s):
                    await wake.wait()


def create_app(settings: Settings) -> faust.App:
    """Build the Faust app for ``settings`` (consumer group = ``settings.app_id``)."""
    app = _App(
        settings.app_id,
        broker=[f"kafka://{host}" for host in settings.kafka_bootstrap.split(",")],
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=settings.partitions,
        # TLS/SASL credentials, metadata age, acks=all, delivery timeout, replication (streams.kafka_security)
        **faust_settings(settings),
        kafka_delivery_timeout_s=settings.kafka_delivery_timeout_s,
        consumer_auto_offset_reset="earliest",
        producer_linger_ms=2,
        broker_session_timeout=settings.kafka_session_timeout_s,
        broker_heartbeat_interval=settings.kafka_heartbeat_interval_s,
        # Wait for events in flight (acknowledged only when handled, see Intake) before a rebalance and before
        # stopping. With False, a rebalance during a PostgreSQL restart lost submissions in 2 of 3 runs
        # (tests/e2e/test_faults_under_load.py).
        stream_wait_empty=True,
        autodiscover=False,
        # No leader election: no timer or agent here runs on the leader only. Faust's leader topic would be one
        # more topic per consumer group (``<app id>-__assignor-__leader``, left behind by every run), created by a
        # CreateTopics call in the Conductor's first subscription, after the worker reported started: a broker
        # restarting then crashed the worker (NodeNotReadyError, exit 1; tests/e2e/test_worker_start.py).
        topic_disable_leader=True,
        store="memory://",
        # Faust creates its data directory (``<app id>-data/v1/tables``) at start even though the memory store
        # keeps nothing there; by default in the working directory, where every worker, test and benchmark run
        # would leave one behind. The system's temporary directory instead.
        datadir=faust_data_dir(settings.app_id),
        web_enabled=settings.web_enabled,
        web_port=settings.web_port,
        web_bind=settings.web_bind,
        web_max_connections=settings.web_max_connections,
        web_header_timeout_s=settings.web_header_timeout_s,
        web_in_thread=False,
        # Faust's own pages (/router/, /table/, /graph/, statistics) are off: they tell anyone the app's
        # partitions and tables (docs/operations-http-and-alerts.md).
        web_router_enabled=False,
        web_tables_enabled=False,
        web_graph_enabled=False,
        web_stats_enabled=False,
        web_metrics_enabled=False,
    )
    metrics.preinitialise([settings.topic("submissions"), settings.topic("polls"), settings.topic("cancellations")])
    lock = asyncio.Lock()
    holder: dict[str, Runtime] = {}

    async def enqueue(topic: str, key: bytes, value: bytes) -> Awaitable[Any]:
        return await app.producer.send(topic, key, value, None, None, None)

    async def send(topic: str, key: bytes, value: bytes) -> None:
        await (await enqueue(topic, key, value))

    def partition_of(topic: str, key: bytes) -> int | None:
        """The partition the producer's partitioner picks for ``key`` (None before its metadata knows ``topic``)."""
        return producer_partition(getattr(app.producer, "_producer", None), topic, key)

    async def runtime() -> Runtime:
        async with lock:
            while "rt" not in holder:
                try:
                    holder["rt"] = await Runtime.create(settings, send, enqueue=enqueue)
                    holder["rt"].routes.partition_of = partition_of
                except Exception as exc:  # PostgreSQL went away since the start-up check: wait, as every stage
                    if not is_outage(exc):
                        raise
                    log.warning("PostgreSQL unavailable while the worker starts, waiting: %s", exc)
                    await asyncio.sleep(RUNTIME_RETRY_S)
                    continue
                log.info("worker %s ready (settings: %s)", holder["rt"].worker, settings)
            return holder["rt"]

    #: The running tasks that write the ledger outside the agents (poll scheduler, outbox relay, lookups).
    ledger_loops: set[asyncio.Task[Any]] = set()
    #: This worker's first polls taken in process (streams.worker.stages.firstpoll), closed with the runtime.
    dispatchers: dict[str, FirstPolls] = {}

    async def ledger_loop(run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run()`` as one of :data:`ledger_loops`, which ``close_runtime`` stops before the runtime closes."""
        task = asyncio.current_task()
        assert task is not None  # a Faust task runs in one
        ledger_loops.add(task)
        try:
            await run()
        finally:
            ledger_loops.discard(task)

    @app.on_before_shutdown.connect  # type: ignore[arg-type]  # mode types receivers as sync-or-awaitable unions
    async def close_runtime(sender: Any, **kwargs: Any) -> None:
        # Sent once the consumer stopped and in-flight events finished, but before mode cancels the app's tasks:
        # stop the loops that write the ledger first, so that the runtime's announcement of this worker's
        # transitions follows its last write; then close the pool, Redis and the HTTP transport's pooled
        # connections (aiohttp logs every session left open at exit as an error). A relay round cancelled here
        # marks nothing: another relay publishes its rows, with the same event ids.
        loops = list(ledger_loops)
        for task in loops:
            task.cancel()
        if loops:
            _, pending = await asyncio.wait(loops, timeout=CLOSE_TIMEOUT_S)
            if pending:  # a loop that did not end: the runtime closes under it (the process is stopping; what it
                # had not written waits for another worker's loop)
                log.warning(
                    "%d ledger loop(s) still running %g s after they were cancelled; closing the runtime anyway",
                    len(pending),
                    CLOSE_TIMEOUT_S,
                )
        first_polls = dispatchers.pop("first_polls", None)
        if first_polls is not None:
            await first_polls.close()
        rt = holder.pop("rt", None)
        if rt is not None:
            await rt.close()

    def topic(role: str) -> Any:
        return app.topic(settings.topic(role), key_type=bytes, value_type=bytes, partitions=settings.partitions)

    submissions = Intake(settings.dispatcher_concurrency, lambda: int(app.consumer_generation_id))
    polls = Intake(settings.observer_concurrency, lambda: int(app.consumer_generation_id))
    cancellations = Intake(CANCEL_CONCURRENCY, lambda: int(app.consumer_generation_id))

    # One actor per agent (concurrency 1): it only reads; handling runs in the Intake's tasks.
    if settings.web_enabled:
        web_app = app.web.web_app  # type: ignore[attr-defined]  # the aiohttp driver's app
        webaccess.install(web_app, settings)
        if settings.callbacks_enabled:
            receivers: dict[str, CallbackReceiver] = {}

            async def callback_view(request: web.Request) -> web.Response:
                if "receiver" not in receivers:
                    receivers["receiver"] = CallbackReceiver(await runtime())
                return await receivers["receiver"].handle(request)

            web_app.router.add_post(settings.callback_path, callback_view)

    @app.agent(topic("submissions"))
    async def dispatch(stream: Any) -> None:
        rt = await runtime()
        if "first_polls" not in dispatchers:  # one per worker: it outlives a restart of the agent's actor
            dispatchers["first_polls"] = FirstPolls(rt, Observer(rt), polls.slots)
        await submissions.consume(stream, Dispatcher(rt, dispatchers["first_polls"]).handle, rt)

    @app.agent(topic("polls"))
    async def observe(stream: Any) -> None:
        rt = await runtime()
        await polls.consume(stream, Observer(rt).handle, rt)

    @app.agent(topic("cancellations"))
    async def cancel(stream: Any) -> None:
        rt = await runtime()
        await cancellations.consume(stream, Canceller(rt).handle, rt)

    @app.task
    async def schedule_polls() -> None:
        await ledger_loop(PollScheduler(await runtime()).run)

    @app.task
    async def relay_outbox() -> None:
        await ledger_loop(OutboxRelay(await runtime()).run)

    @app.task
    async def listen_outbox() -> None:
        await (await runtime()).listen_outbox()

    @app.task
    async def reconcile_lookups() -> None:
        if settings.lookup_enabled:
            reconciler = Reconciler(await runtime())
            await ledger_loop(lambda: run_forever(reconciler.tick, RECONCILER_IDLE_S))

    @app.task
    async def watch_partitions() -> None:
        """Name the product's partitions without a leader (log line, gauge), from the producer's metadata."""
        blocked = BlockedPartitions()
        produced = [settings.topic(role) for role in ("polls", "outputs_delivered", "transitions", "dead_letter")]
        rt = await runtime()  # its relay and poll scheduler skip them (PartitionRoutes)
        while True:
            await asyncio.sleep(BLOCKED_CHECK_INTERVAL_S)
            client = getattr(getattr(app.producer, "_producer", None), "client", None)
            if client is not None:
                blocked.update(blocked_partitions(client.cluster, produced))
                rt.routes.update(blocked.blocked)

    @app.task
    async def check_clock() -> None:
        rt = await runtime()
        if rt.pool is not None:  # an in-memory ledger has no database clock
            await ClockCheck(rt.pool, settings).run()

    snapshots: dict[str, Snapshotter] = {}
    no_snapshot = Snapshot()

    def latest_snapshot() -> Snapshot:
        taker = snapshots.get("taker")
        return taker.latest if taker is not None else no_snapshot

    def blocked() -> dict[str, int]:
        return {
            "dispatch": submissions.acks.blocked_partitions(),
            "observe": polls.acks.blocked_partitions(),
            "cancel": cancellations.acks.blocked_partitions(),
        }

    @app.task
    async def take_snapshots() -> None:
        if not settings.web_enabled:
            return
        taker = Snapshotter((await runtime()).ledger_pool(), settings, blocked)
        snapshots["taker"] = taker
        try:
            while True:
                await taker.take()
                await asyncio.sleep(settings.web_snapshot_interval_s)
        finally:
            await taker.close()

    assignment: dict[str, bool] = {"received": False}

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]  # mode types receivers as unions
    async def note_assignment(sender: Any, *args: Any, **kwargs: Any) -> None:
        assignment["received"] = True

    @app.page("/metrics")
    async def metrics_view(web: Any, request: Any) -> Any:
        return web.bytes(generate_latest(), content_type="text/plain")

    @app.page("/livez")
    async def liveness_view(web: Any, request: Any) -> Any:
        reasons = liveness_failures(app)
        return web.json({"live": not reasons, "reasons": reasons}, status=503 if reasons else 200)

    async def readiness(web: Any, request: Any) -> Any:
        checks = await readiness_checks(app, holder.get("rt"), settings, assignment["received"])
        reasons = [f"{name}: {detail}" for name, (ok, detail) in checks.items() if not ok]
        body = {
            "ready": not reasons,
            "worker": holder["rt"].worker if "rt" in holder else None,
            "checks": {name: {"ok": ok, "detail": detail} for name, (ok, detail) in checks.items()},
            "reasons": reasons,
        }
        return web.json(body, status=503 if reasons else 200)

    app.page("/readyz")(readiness)
    app.page("/healthz")(readiness)  # the harness's and older deployments' probe: the same answer as /readyz
    # The live view: / and /operations/{operation_id} (streams.oncall.liveview).
    register_pages(app, runtime, latest_snapshot, settings)
    return app


def liveness_failures(app: faust.App) -> list[str]:
    """Why the worker is not live (empty when it is): the app or an agent crashed or stopped, or an agent has no
    running actor. Answering at all shows the event loop turns."""
    reasons = []
    if app.crashed or app.should_stop:
        reasons.append(f"the app is {app.state}")
    for name, agent in app.agents.items():
        if agent.crashed or agent.should_stop:
            reasons.append(f"agent {name} is {agent.state}")
            continue
        actors = list(getattr(agent, "_actors", ()))
        running = [a for a in actors if getattr(a, "actor_task", None) is not None and not a.actor_task.done()]
        if agent.started and not running:
            reasons.append(f"agent {name} has no running actor")
    return reasons


async def readiness_checks(
    app: faust.App, rt: Runtime | None, settings: Settings, assigned: bool
) -> dict[str, tuple[bool, str]]:
    """{service: (ok, detail)} for ``postgres``, ``redis`` and ``kafka`` (the consumer group's assignment
    received and no rebalance under way), each bounded by ``web_probe_timeout_s``; never raises."""
    timeout_s = settings.web_probe_timeout_s

    async def postgres() -> tuple[bool, str]:
        if rt is None:
            return False, "not connected yet (the worker is starting or waiting for PostgreSQL)"
        try:
            await answer_within(ping_ledger(rt.ledger_pool()), timeout_s)
        except TimeoutError:
            return False, f"no answer within {timeout_s} s"
        except LedgerUnavailableError as exc:
            return False, str(exc)
        return True, "answers"

    async def redis() -> tuple[bool, str]:
        if rt is None:
            return False, "not connected yet (the worker is starting)"
        try:
            healthy = await answer_within(rt.leases.healthy(), timeout_s)
        except TimeoutError:
            return False, f"no answer within {timeout_s} s"
        return (True, "answers") if healthy else (False, "does not answer PING")

    async def kafka() -> tuple[bool, str]:
        if not assigned:
            return False, "no partition assignment received yet (joining the consumer group)"
        if app.rebalancing:
            return False, "the consumer group is rebalancing"
        return True, f"{len(app.consumer.assignment())} partitions assigned"

    pg, rd, kf = await asyncio.gather(postgres(), redis(), kafka())
    return {"postgres": pg, "redis": rd, "kafka": kf}
