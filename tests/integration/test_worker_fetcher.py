"""The worker's aiokafka consumer paces its fetcher's idle rounds by :data:`streams.worker.app.FETCHER_IDLE_WAKEUP_S`
(aiokafka's ``consumer_timeout_ms``, which Faust does not pass): the value is set on the consumer Faust makes,
before ``start()`` builds the fetcher from it. Checked on the fetcher a real start made, since the attribute is
aiokafka's own; and a record sent to an idle, assigned partition is read."""

from __future__ import annotations

from typing import Any, cast

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from streams.config import Settings
from streams.worker.app import FETCHER_IDLE_WAKEUP_S, create_app

pytestmark = pytest.mark.integration


async def test_the_worker_consumer_fetcher_waits_its_idle_bound_and_still_reads_new_records(
    migrated: Settings, one_partition_topic: str
) -> None:
    app = create_app(migrated.replace(web_enabled=False))
    thread = cast(Any, app.consumer)._thread  # Faust's consumer thread, a _QuietFetcherThread
    consumer = thread._create_worker_consumer(app.transport)
    tp = TopicPartition(one_partition_topic, 0)
    await consumer.start()
    try:
        assert consumer._fetcher._fetcher_timeout == FETCHER_IDLE_WAKEUP_S == 1.5
        consumer.assign([tp])
        assert await consumer.getmany(tp, timeout_ms=200) == {}  # idle: nothing yet
        producer = AIOKafkaProducer(bootstrap_servers=migrated.kafka_bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(one_partition_topic, b"r0", partition=0)
        finally:
            await producer.stop()
        batch = await consumer.getmany(tp, timeout_ms=10_000)
        assert [r.value for r in batch.get(tp, [])] == [b"r0"]
    finally:
        await consumer.stop()
