"""The job-queue peer: what a team would pick instead of writing coordination, built with procrastinate (a
PostgreSQL job queue) in its own idioms. Several copies of this process share the submissions through a Kafka
consumer group; each accepts the operation into the ledger and defers a ``submit`` job (queueing lock
``submit:<operation>``); procrastinate's workers run it: mark submitting, POST once, save the job id and defer a
``poll`` job. A ``poll`` job GETs the remote job once and saves the answer; while the job is not final it defers
the next ``poll`` of the same operation (queueing lock and lock ``poll:<operation>``: one poll waiting and one
running per operation at most), and when it succeeded it saves the outputs and publishes to Kafka those it
saved first (an insert that finds the output already there publishes nothing: outputs delivered once while no
copy dies between the insert and the publish).

No lease, no fencing value, no outbox; procrastinate's jobs live in a database of their own
(:func:`queue_database_url`, its schema applied with procrastinate's own API by :func:`apply_schema`), the
operations in the run's ledger, as the naive peer's: the benchmark reads both with the same checks.

Run by the benchmark: ``python -m streams_harness.bench.procrastinate_peer`` with the run's ``STREAMS_*``
settings (its consumer group is ``STREAMS_APP_ID``); runs until stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

import asyncpg
import orjson
import procrastinate
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from procrastinate.exceptions import AlreadyEnqueued
from procrastinate.types import TimeDeltaParams

from streams.config import Settings
from streams.errors import RemoteError
from streams.ledger.pool import create_pool
from streams.ledger.store import Ledger
from streams.model.states import OperationState
from streams.remote.client import RemoteClient
from streams_harness.bench.counters import BENCH
from streams_harness.bench.peers import consume_bounded

WORKER = f"procrastinate:{socket.gethostname()}:{os.getpid()}"

#: procrastinate's queue of the peer's jobs.
QUEUE = "streams_bench"

#: Suffix of the queue's database name after the run's ledger database's (see :func:`queue_database_url`).
QUEUE_DATABASE_SUFFIX = "queue"

#: The states after which a job is not polled again.
FINAL = frozenset({OperationState.SUCCEEDED, OperationState.FAILED, OperationState.CANCELED})

tasks = procrastinate.Blueprint()


def queue_database_url(ledger_database_url: str) -> str:
    """The URL of the peer's procrastinate database next to the run's ledger database: ``<ledger name>_queue``
    (what :func:`streams_harness.services.create_run_database` creates for the run id ``queue``)."""
    base, _, name = ledger_database_url.rpartition("/")
    name, _, query = name.partition("?")
    return f"{base}/{name}_{QUEUE_DATABASE_SUFFIX}" + (f"?{query}" if query else "")


def make_app(queue_url: str, max_connections: int) -> procrastinate.App:
    """A procrastinate app on the database ``queue_url`` with the peer's tasks, at most ``max_connections``
    connections in its pool (not opened)."""
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=queue_url, min_size=1, max_size=max_connections)
    )
    app.add_tasks_from(tasks, namespace="bench")
    return app


async def apply_schema(queue_url: str) -> None:
    """Apply procrastinate's schema to the empty database ``queue_url`` (its own schema manager)."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=queue_url, min_size=1, max_size=2))
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


class ProcrastinatePeer:
    """One copy of the job-queue peer's state (see the module docstring), handed to its jobs."""

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        remote: RemoteClient,
        producer: AIOKafkaProducer,
    ):
        self.settings = settings
        self.pool = pool
        self.ledger = Ledger(pool, WORKER)
        self.remote = remote
        self.producer = producer

    async def accept(self, event: dict[str, Any]) -> None:
        """Accept one submission into the ledger and defer its ``submit`` job (a replayed one: nothing)."""
        operation_id = event["operation_id"]
        request_text = orjson.dumps(event["request"]).decode()
        if not await self.ledger.accept(operation_id, request_text, submitted_at_ms=event["submitted_at_ms"]):
            return
        with contextlib.suppress(AlreadyEnqueued):
            await submit.configure(queueing_lock=f"submit:{operation_id}").defer_async(operation_id=operation_id)

    async def consume(self, consumer: AIOKafkaConsumer) -> None:
        """Accept the submissions of ``consumer``, at most ``dispatcher_concurrency`` at once."""
        await consume_bounded(consumer, self.accept, self.settings.dispatcher_concurrency)

    async def submit(self, operation_id: str) -> None:
        """The ``submit`` job: POST once, save the job id, defer the first poll."""
        request_text = await BENCH.peer_request.fetchval(self.pool, operation_id=operation_id)
        await BENCH.naive_mark_submitting.execute(self.pool, operation_id=operation_id, worker=WORKER)
        try:
            result = await self.remote.submit(operation_id, request_text)
        except RemoteError:
            return
        await BENCH.naive_save_job.execute(
            self.pool, operation_id=operation_id, remote_job_id=result.job_id, worker=WORKER
        )
        await self.defer_poll(operation_id, result.job_id, delay_s=0.0)

    async def defer_poll(self, operation_id: str, job_id: str, *, delay_s: float) -> None:
        """Defer the operation's next ``poll`` job in ``delay_s`` seconds (one waiting at most)."""
        lock = f"poll:{operation_id}"
        delay: TimeDeltaParams | None = {"milliseconds": round(1000 * delay_s)} if delay_s else None
        deferrer = poll.configure(lock=lock, queueing_lock=lock, schedule_in=delay)
        with contextlib.suppress(AlreadyEnqueued):
            await deferrer.defer_async(operation_id=operation_id, job_id=job_id)

    async def poll(self, operation_id: str, job_id: str) -> None:
        """The ``poll`` job: one GET, the answer saved; the next poll deferred, or the outputs delivered."""
        try:
            snapshot = await self.remote.observe(operation_id, job_id)
        except RemoteError:
            await self.defer_poll(operation_id, job_id, delay_s=self.settings.poll_scheduler_interval_s)
            return
        observation = orjson.dumps(snapshot.as_observation()).decode()
        with contextlib.suppress(asyncpg.PostgresError):  # e.g. the ledger's trigger refused a step backwards
            await BENCH.naive_save_state.execute(
                self.pool,
                operation_id=operation_id,
                state=snapshot.state.value,
                observation=observation,
                remote_completed_at_ms=snapshot.completed_at_ms,
                worker=WORKER,
            )
        if snapshot.state not in FINAL:
            await self.defer_poll(operation_id, job_id, delay_s=self.settings.poll_scheduler_interval_s)
            return
        if snapshot.state is not OperationState.SUCCEEDED:
            return
        rows = await BENCH.peer_save_outputs_once.fetch(self.pool, operation_id=operation_id, outputs=snapshot.outputs)
        for row in rows:
            value = {
                "event_id": f"output:{operation_id}:{row['output_id']}",
                "operation_id": operation_id,
                "output_id": row["output_id"],
                "position": row["position"],
                "remote_job_id": job_id,
                "output": orjson.loads(row["payload"]),
                "remote_completed_at_ms": snapshot.completed_at_ms,
            }
            await self.producer.send_and_wait(
                self.settings.topic("outputs_delivered"), orjson.dumps(value), key=operation_id.encode()
            )


def _peer(context: procrastinate.JobContext) -> ProcrastinatePeer:
    peer: ProcrastinatePeer = context.additional_context["peer"]
    return peer


@tasks.task(name="submit", queue=QUEUE, pass_context=True)
async def submit(context: procrastinate.JobContext, operation_id: str) -> None:
    """See :meth:`ProcrastinatePeer.submit`."""
    await _peer(context).submit(operation_id)


@tasks.task(name="poll", queue=QUEUE, pass_context=True)
async def poll(context: procrastinate.JobContext, operation_id: str, job_id: str) -> None:
    """See :meth:`ProcrastinatePeer.poll`."""
    await _peer(context).poll(operation_id, job_id)


async def run(settings: Settings) -> None:
    """Run one copy (its consumer and procrastinate's worker) until cancelled."""
    database_url = settings.database_url.get_secret_value()
    concurrency = settings.observer_concurrency
    app = make_app(queue_database_url(database_url), max_connections=settings.db_pool_max_size)
    pool = await create_pool(database_url, min_size=2, max_size=settings.db_pool_max_size)
    remote = RemoteClient.from_settings(settings)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all", linger_ms=2)
    consumer = AIOKafkaConsumer(
        settings.topic("submissions"),
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=settings.app_id,
        auto_offset_reset="earliest",
    )
    await producer.start()
    await consumer.start()
    try:
        async with app.open_async():
            peer = ProcrastinatePeer(settings, pool, remote, producer)
            worker = app.run_worker_async(
                queues=[QUEUE],
                concurrency=concurrency,
                name=WORKER,
                fetch_job_polling_interval=settings.poll_scheduler_interval_s,
                delete_jobs="successful",
                additional_context={"peer": peer},
                install_signal_handlers=False,  # SIGTERM ends the process, as the other peers
            )
            await asyncio.gather(peer.consume(consumer), worker)
    finally:
        await consumer.stop()
        await producer.stop()
        await remote.aclose()
        await pool.close()


def main() -> None:
    """Run one copy with the ``STREAMS_*`` settings of the environment."""
    asyncio.run(run(Settings.from_env()))


if __name__ == "__main__":
    # run from the imported module, whose blueprint the app and the benchmark share (not this __main__ copy)
    from streams_harness.bench import procrastinate_peer

    procrastinate_peer.main()
