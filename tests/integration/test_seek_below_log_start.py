"""A partition whose head retention deleted (log start offset above 0) is read from its log start when the
worker's consumer seeks it to 0 (:class:`streams.worker.app._SeekingConsumer` on a partition without a committed
offset): the broker answers OffsetOutOfRange and aiokafka resets to the earliest offset, by the reset policy the
worker's app sets (``earliest``). No record still in the log is skipped, and the seek does not loop."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from streams.config import Settings
from streams.worker.app import create_app

pytestmark = pytest.mark.integration


async def test_a_seek_to_0_below_the_log_start_reads_from_the_log_start(
    migrated: Settings, kafka_admin: AIOKafkaAdminClient, one_partition_topic: str
) -> None:
    app = create_app(migrated.replace(web_enabled=False))
    reset = app.conf.consumer_auto_offset_reset
    assert reset == "earliest"  # what makes the seek to 0 safe (with "latest" the records would be skipped)
    topic = one_partition_topic
    tp = TopicPartition(topic, 0)
    producer = AIOKafkaProducer(bootstrap_servers=migrated.kafka_bootstrap)
    await producer.start()
    try:
        for i in range(5):
            await producer.send_and_wait(topic, f"r{i}".encode(), partition=0)
    finally:
        await producer.stop()
    await kafka_admin.delete_records(
        {tp: RecordsToDelete(3)}
    )  # what retention does to the head: the log now starts at 3
    consumer = AIOKafkaConsumer(
        bootstrap_servers=migrated.kafka_bootstrap, enable_auto_commit=False, auto_offset_reset=reset
    )
    await consumer.start()
    try:
        consumer.assign([tp])
        assert (await consumer.beginning_offsets([tp]))[tp] == 3
        consumer.seek(tp, 0)  # as _SeekingConsumer.seek_to_committed does (through Faust's seek_wait)
        read: list[tuple[int, bytes | None]] = []
        while len(read) < 2:
            batch = await consumer.getmany(tp, timeout_ms=10_000)
            assert batch, "nothing read within 10 s after the seek below the log start"
            read += [(r.offset, r.value) for r in batch[tp]]
        assert read == [(3, b"r3"), (4, b"r4")]
    finally:
        await consumer.stop()
