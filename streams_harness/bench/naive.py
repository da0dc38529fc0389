"""The naive peer: what a team writes first. Several copies of this process share the submissions through a
Kafka consumer group; each inserts the operation, marks it submitting, POSTs and saves the job id; and each
polls *every* unfinished job straight from PostgreSQL on a timer, GETs it and saves the answer, publishing the
outputs it sees as succeeded directly to Kafka. No lease, no fencing value, no outbox: copies poll the same jobs
(the GETs a lease saves) and may publish an output more than once.

It uses the product's remote client (the same HTTP transport as the pipeline) and the ledger's tables, so
only the coordination differs.

Run by the benchmark: ``python -m streams_harness.bench.naive`` with the run's ``STREAMS_*`` settings (its
consumer group is ``STREAMS_APP_ID``); runs until stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

import asyncpg
import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from streams.config import Settings
from streams.errors import RemoteError
from streams.ledger.pool import create_pool
from streams.ledger.store import Ledger
from streams.model.states import OperationState
from streams.remote.client import RemoteClient
from streams_harness.bench.counters import BENCH
from streams_harness.bench.peers import consume_bounded

WORKER = f"naive:{socket.gethostname()}:{os.getpid()}"


class NaivePeer:
    """One copy of the naive peer (see the module docstring)."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool, remote: RemoteClient, producer: AIOKafkaProducer):
        self.settings = settings
        self.pool = pool
        self.ledger = Ledger(pool, WORKER)
        self.remote = remote
        self.producer = producer

    async def submit(self, event: dict[str, Any]) -> None:
        operation_id = event["operation_id"]
        request_text = orjson.dumps(event["request"]).decode()
        await self.ledger.accept(operation_id, request_text, submitted_at_ms=event["submitted_at_ms"])
        await BENCH.naive_mark_submitting.execute(self.pool, operation_id=operation_id, worker=WORKER)
        try:
            result = await self.remote.submit(operation_id, request_text)
        except RemoteError:
            return
        await BENCH.naive_save_job.execute(
            self.pool, operation_id=operation_id, remote_job_id=result.job_id, worker=WORKER
        )

    async def consume(self, consumer: AIOKafkaConsumer) -> None:
        """Accept the submissions of ``consumer``, at most ``dispatcher_concurrency`` at once."""
        await consume_bounded(consumer, self.submit, self.settings.dispatcher_concurrency)

    async def observe(self, operation_id: str, job_id: str) -> None:
        try:
            snapshot = await self.remote.observe(operation_id, job_id)
        except RemoteError:
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
        if snapshot.state is not OperationState.SUCCEEDED:
            return
        rows = await BENCH.naive_save_outputs.fetch(self.pool, operation_id=operation_id, outputs=snapshot.outputs)
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

    async def poll_forever(self) -> None:
        slots = asyncio.Semaphore(self.settings.observer_concurrency)

        async def one(operation_id: str, job_id: str) -> None:
            async with slots:
                await self.observe(operation_id, job_id)

        while True:
            rows = await BENCH.naive_pollable.fetch(self.pool, limit=self.settings.poll_batch_size)
            await asyncio.gather(*(one(r["operation_id"], r["remote_job_id"]) for r in rows))
            await asyncio.sleep(self.settings.poll_scheduler_interval_s)


async def run(settings: Settings) -> None:
    """Run one copy until cancelled."""
    pool = await create_pool(settings.database_url.get_secret_value(), min_size=2, max_size=settings.db_pool_max_size)
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
    peer = NaivePeer(settings, pool, remote, producer)
    try:
        await asyncio.gather(peer.consume(consumer), peer.poll_forever())
    finally:
        await consumer.stop()
        await producer.stop()
        await remote.aclose()
        await pool.close()


def main() -> None:
    """Run one copy with the ``STREAMS_*`` settings of the environment."""
    asyncio.run(run(Settings.from_env()))


if __name__ == "__main__":
    main()
