"""``Runtime.send_all`` over a real Kafka producer (the worker's path: records handed to the producer's buffer in
order, their acknowledgements awaited together): every record lands, in order within its partition; a record the
producer refuses (too large) gets its own exception in its place while the others land."""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import MessageSizeTooLargeError

from streams.clients.follow import read_topic_to_end
from streams.config import Settings
from streams.setup.admin import KafkaAdmin
from streams.wire import exactjson
from streams.worker.runtime import Runtime
from streams.worker.stages.relay import OutboxRelay
from tests.integration.test_relay_and_dead_letters import succeeded_operation

pytestmark = pytest.mark.integration


@pytest.fixture
async def producer(migrated: Settings) -> AsyncIterator[AIOKafkaProducer]:
    p = AIOKafkaProducer(bootstrap_servers=migrated.kafka_bootstrap, acks="all", max_request_size=64 * 1024)
    await p.start()
    yield p
    await p.stop()


@pytest.fixture
async def enqueuing_runtime(runtime: Runtime, producer: AIOKafkaProducer) -> Runtime:
    async def enqueue(topic: str, key: bytes, value: bytes) -> Any:
        return await producer.send(topic, value, key=key)

    runtime.enqueue = enqueue
    return runtime


async def read_back(settings: Settings, topic: str, key: bytes, partition_offsets: dict[int, int]) -> list[bytes]:
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        out: list[bytes] = []
        for partition, start in partition_offsets.items():
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            consumer.seek(tp, start)
            end = (await consumer.end_offsets([tp]))[tp]
            while True:
                batch = await consumer.getmany(tp, timeout_ms=1000)
                out.extend(m.value for m in batch.get(tp, []) if m.key == key and m.value is not None)
                if await consumer.position(tp) >= end:
                    break
        return out
    finally:
        await consumer.stop()


async def test_records_land_in_order_and_a_refused_one_gets_its_own_error(
    enqueuing_runtime: Runtime, settings: Settings, producer: AIOKafkaProducer
) -> None:
    run = uuid.uuid4().hex[:8]
    topic = f"{settings.topic_prefix}send-all-{run}"  # a topic of its own: no other test reads what it writes
    async with KafkaAdmin(settings) as admin:
        assert await admin.create_topics([topic], 2) == [topic]
    key = f"send-all-{run}".encode()
    partitions = sorted(await producer.partitions_for(topic))
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
    finally:
        await consumer.stop()
    before = {tp.partition: offset for tp, offset in ends.items()}
    values = [f'{{"record": {i}}}'.encode() for i in range(200)]
    values[57] = b"x" * (128 * 1024)  # over the producer's max_request_size: refused before it is buffered
    records = [(topic, key, v) for v in values]

    results = await enqueuing_runtime.send_all(records)

    assert [i for i, r in enumerate(results) if r is not None] == [57]
    assert isinstance(results[57], MessageSizeTooLargeError)
    landed = await read_back(settings, topic, key, before)
    assert landed == [v for i, v in enumerate(values) if i != 57]  # each once, in the order handed over
    async with KafkaAdmin(settings) as admin:
        await admin.delete_topics([topic])


async def test_without_an_enqueue_each_record_is_sent_and_failures_are_returned(
    runtime: Runtime, settings: Settings
) -> None:
    sent: list[tuple[str, bytes, bytes]] = []

    async def send(topic: str, key: bytes, value: bytes) -> None:
        if value == b"bad":
            raise RuntimeError("refused")
        sent.append((topic, key, value))

    runtime.send, runtime.enqueue = send, None
    results = await runtime.send_all([("t", b"k", b"a"), ("t", b"k", b"bad"), ("t", b"k", b"c")])
    assert [type(r).__name__ if r else None for r in results] == [None, "RuntimeError", None]
    assert sent == [("t", b"k", b"a"), ("t", b"k", b"c")]


async def test_an_output_too_large_to_publish_does_not_stop_every_later_delivery(
    enqueuing_runtime: Runtime, pool: asyncpg.Pool
) -> None:
    # The provider's output is over the producer's record limit (64 KiB here, ~1 MB in the worker): the relay
    # must not stay stuck on its row, republishing the rows beside it each round and never reaching later ones.
    relay = OutboxRelay(enqueuing_runtime)
    while await relay.tick():  # rows other tests left
        pass
    big, small = f"big-{uuid.uuid4().hex[:6]}", f"small-{uuid.uuid4().hex[:6]}"
    try:
        await succeeded_operation(enqueuing_runtime, big, 1, "x" * 100_000)
        await succeeded_operation(enqueuing_runtime, small, 1, "y")
        for _ in range(3):
            await relay.tick()
        unpublished = "SELECT count(*) FROM outbox WHERE published_at IS NULL AND operation_id = $1"
        assert await pool.fetchval(unpublished, small) == 0
        assert await pool.fetchval(unpublished, big) == 0  # its refused row dead-lettered, then marked
        letters = [
            r.value
            for r in await read_topic_to_end(enqueuing_runtime.settings, "dead_letter")
            if r.value["source_topic"] == enqueuing_runtime.settings.topic("outputs_delivered")
            and big in r.value["error"]
        ]
        assert len(letters) == 1
        letter = letters[0]
        assert letter["reason"] == "unpublishable" and "MessageSizeTooLargeError" in letter["error"]
        original = base64.b64decode(letter["original_base64"])
        assert letter["original_size"] > 100_000 and not letter["original_truncated"]
        assert exactjson.loads(original)["output"] == {"id": "out_0", "text": "x" * 100_000}
    finally:  # the rows stuck here would stop every later relay test on this database
        await pool.execute(
            "UPDATE outbox SET published_at = now() WHERE published_at IS NULL AND operation_id = ANY($1)",
            [big, small],
        )
