"""The Faust application: topics, agents, timers and web views of one worker process.

Layout (faust-streaming user guide, "medium/large projects"): the pipeline logic lives in plain classes
(:mod:`streams.dispatcher`, :mod:`streams.observer`, :mod:`streams.scheduler`, :mod:`streams.relay`); this
module only wires them to Kafka.

* ``dispatch`` agent: ``generation.submissions`` -> :class:`~streams.dispatcher.Dispatcher`.
* ``observe`` agent: ``generation.polls`` -> :class:`~streams.observer.Observer`.
* ``schedule_polls`` task: :class:`~streams.scheduler.PollScheduler` (due polls, reconciliation), in a loop.
* ``relay_outbox`` task: :class:`~streams.relay.OutboxRelay`, in a loop.
* ``reconcile_lookups`` task (only with ``lookup_enabled``): :class:`~streams.reconciler.Reconciler`, in a loop
  of its own, so a slow lookup never delays poll scheduling.
* Web: ``GET /metrics`` (Prometheus text) and ``GET /healthz``.

An unexpected exception while handling an event never stops the partition: the event is retried
(:data:`HANDLER_ATTEMPTS`), then goes to the dead-letter topic with reason ``processing_error`` and its
original bytes, so it can be replayed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import faust
import tenacity
from prometheus_client import generate_latest

from streams.config import Settings
from streams.dispatcher import Dispatcher
from streams.errors import InvalidEventError
from streams.observer import Observer
from streams.reconciler import Reconciler
from streams.relay import OutboxRelay
from streams.runtime import RawMessage, Runtime
from streams.scheduler import PollScheduler

log = logging.getLogger(__name__)


#: Attempts at an event whose handling raised unexpectedly, before it is dead-lettered (handlers are
#: idempotent, so a retry is safe; outages of PostgreSQL and Redis are waited out inside the handlers).
HANDLER_ATTEMPTS = 5

#: Pause of the reconciler's loop when no lookup was due (s).
RECONCILER_IDLE_S = 1.0


async def handle_with_retries(rt: Runtime, handle: Callable[[RawMessage], Awaitable[None]], raw: RawMessage) -> None:
    """Run ``handle(raw)``; retry unexpected errors with backoff, then dead-letter the event with reason
    ``processing_error`` and its original bytes (it can be replayed from there). Never raises."""
    retrying = tenacity.AsyncRetrying(
        stop=tenacity.stop_after_attempt(HANDLER_ATTEMPTS),
        wait=tenacity.wait_exponential_jitter(multiplier=0.2, max=5.0),
        reraise=True,
    )
    try:
        async for attempt in retrying:
            with attempt:
                await handle(raw)
    except Exception as exc:
        log.exception(
            "handling %s[%s]@%s failed %d times; dead-lettering it",
            raw.topic,
            raw.partition,
            raw.offset,
            HANDLER_ATTEMPTS,
        )
        await rt.dead_letter(raw, InvalidEventError("processing_error", f"{type(exc).__name__}: {exc}"))


def create_app(settings: Settings) -> faust.App:
    """Build the Faust app for ``settings`` (consumer group = ``settings.app_id``)."""
    app = faust.App(
        settings.app_id,
        broker=[f"kafka://{host}" for host in settings.kafka_bootstrap.split(",")],
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=settings.partitions,
        topic_replication_factor=1,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        producer_linger_ms=2,
        broker_session_timeout=settings.kafka_session_timeout_s,
        broker_heartbeat_interval=settings.kafka_heartbeat_interval_s,
        # Wait for events in flight before a rebalance (Faust's default). With False, a rebalance during a
        # PostgreSQL restart lost submissions in 2 of 3 runs (tests/e2e/test_faults_under_load.py).
        stream_wait_empty=True,
        autodiscover=False,
        store="memory://",
        web_enabled=settings.web_enabled,
        web_port=settings.web_port,
        web_bind="0.0.0.0",
        web_in_thread=False,
    )
    lock = asyncio.Lock()
    holder: dict[str, Runtime] = {}

    async def send(topic: str, key: bytes, value: bytes) -> None:
        fut = await app.producer.send(topic, key, value, None, None, None)
        await fut

    async def runtime() -> Runtime:
        async with lock:
            if "rt" not in holder:
                holder["rt"] = await Runtime.create(settings, send)
                log.info("worker %s ready (settings: %s)", holder["rt"].worker, settings)
            return holder["rt"]

    def topic(role: str) -> Any:
        return app.topic(settings.topic(role), key_type=bytes, value_type=bytes, partitions=settings.partitions)

    async def consume(stream: Any, handler: Callable[[Runtime], Callable[[RawMessage], Awaitable[None]]]) -> None:
        rt = await runtime()
        handle = handler(rt)
        async for event in stream.events():
            m = event.message
            await handle_with_retries(rt, handle, RawMessage(m.topic, m.partition, m.offset, m.key, m.value))

    @app.agent(topic("submissions"), concurrency=settings.dispatcher_concurrency)
    async def dispatch(stream: Any) -> None:
        await consume(stream, lambda rt: Dispatcher(rt).handle)

    @app.agent(topic("polls"), concurrency=settings.observer_concurrency)
    async def observe(stream: Any) -> None:
        await consume(stream, lambda rt: Observer(rt).handle)

    async def run_forever(tick: Callable[[], Awaitable[int]], idle_s: float) -> None:
        """Run ``tick`` back to back while it finds work, sleeping ``idle_s`` when it finds none."""
        while True:
            try:
                busy = await tick()
            except Exception:
                log.exception("periodic task failed; retrying")
                busy = 0
            if not busy:
                await asyncio.sleep(idle_s)

    @app.task
    async def schedule_polls() -> None:
        await run_forever(PollScheduler(await runtime()).tick, settings.poll_scheduler_interval_s)

    @app.task
    async def relay_outbox() -> None:
        await run_forever(OutboxRelay(await runtime()).tick, settings.relay_interval_s)

    @app.task
    async def reconcile_lookups() -> None:
        if settings.lookup_enabled:
            await run_forever(Reconciler(await runtime()).tick, RECONCILER_IDLE_S)

    @app.page("/metrics")
    async def metrics_view(web: Any, request: Any) -> Any:
        return web.bytes(generate_latest(), content_type="text/plain")

    @app.page("/healthz")
    async def health_view(web: Any, request: Any) -> Any:
        rt = await runtime()
        redis_ok = await rt.leases.healthy()
        return web.json({"worker": rt.worker, "redis": redis_ok})

    return app
