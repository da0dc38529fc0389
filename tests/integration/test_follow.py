"""``streams follow`` with a consumer group: offsets committed only for what was handled, and a repeat the relay
published around a restart printed once (streams/clients/follow.py)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import TopicPartition

from streams.clients.follow import EventDeduplicator, follow_outputs, learn_event_ids
from streams.config import Settings
from streams.setup.admin import create_topics, delete_topics
from tests.integration.operators_support import streams_cli
from tests.support import unique_settings

pytestmark = pytest.mark.integration


def output(op: str, text: str) -> dict[str, Any]:
    return {"event_id": f"output:{op}:out_0", "operation_id": op, "output_id": "out_0", "output": {"text": text}}


async def taken(settings: Settings, group: str, n: int) -> list[dict[str, Any]]:
    """The first ``n`` values ``follow_outputs`` yields with consumer group ``group``; then it is stopped."""
    got: list[dict[str, Any]] = []
    async with contextlib.aclosing(follow_outputs(settings, group_id=group)) as outputs:
        async for value in outputs:
            got.append(value)
            if len(got) >= n:
                break
    return got


@dataclass
class OutputsTopic:
    """A topic prefix of its own with its outputs topic, a producer on it and a consumer group name."""

    settings: Settings
    group: str
    producer: AIOKafkaProducer

    async def publish(self, *ops: str) -> None:
        """One output of each operation, keyed by its id (a repeat is the same record again)."""
        for op in ops:
            await self.producer.send_and_wait(
                self.settings.topic("outputs_delivered"), orjson.dumps(output(op, op)), key=op.encode()
            )


@pytest.fixture
async def outputs(base_settings: Settings) -> AsyncIterator[OutputsTopic]:
    settings = unique_settings(base_settings, partitions=1)
    await create_topics(settings)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        yield OutputsTopic(settings, f"follow-{uuid.uuid4().hex[:6]}", producer)
    finally:
        await producer.stop()
        await delete_topics(settings)


async def test_a_restart_resumes_after_what_was_handled_and_skips_a_repeat_of_it(outputs: OutputsTopic) -> None:
    """The consumer auto-committed what it had fetched, not what was printed, and remembered event ids only in
    memory: a relay's repeat published before a restart was printed again by the next run."""
    await outputs.publish("a", "b", "c")
    assert [v["operation_id"] for v in await taken(outputs.settings, outputs.group, 2)] == ["a", "b"]
    await outputs.publish("b", "d")  # the relay repeats b (published, not marked, then its next round); d is new
    assert [v["operation_id"] for v in await taken(outputs.settings, outputs.group, 2)] == ["c", "d"]


async def test_the_command_with_a_count_commits_what_it_printed(outputs: OutputsTopic) -> None:
    """``streams follow --group-id G --count 1`` returned from inside its loop: the generator was closed only by the
    event loop's shutdown, its last commit cut off, and every run printed the same first output."""
    await outputs.publish("a", "b", "c")
    printed = []
    for _ in range(3):
        result = await streams_cli(outputs.settings, "follow", "--group-id", outputs.group, "--count", "1")
        assert result.exit_code == 0, result.stderr
        printed += [orjson.loads(line)["operation_id"] for line in result.stdout.splitlines()]
    assert printed == ["a", "b", "c"]


async def test_a_committed_offset_past_the_end_learns_nothing(outputs: OutputsTopic) -> None:
    """A topic made again under the same group: the records below the stale offset are new, not handled before; the
    look-back read them and took their ids for seen, so the group skipped them."""
    await outputs.publish("a", "b", "c")
    tp = TopicPartition(outputs.settings.topic("outputs_delivered"), 0)
    dedupe = EventDeduplicator()
    assert await learn_event_ids(outputs.settings, {tp: 12_000}, dedupe) == {tp: 0}
    assert dedupe.first_time("output:a:out_0")
    assert await learn_event_ids(outputs.settings, {tp: 2}, dedupe) == {tp: 2}  # a and b, before offset 2
    assert not dedupe.first_time("output:b:out_0") and dedupe.first_time("output:c:out_0")


async def test_one_look_back_learns_each_partition_up_to_its_own_offset(base_settings: Settings) -> None:
    """The look-back reads every partition of an assignment with one consumer (it opened one per partition), each
    up to its own committed offset, and tells each partition apart as it is done."""
    settings = unique_settings(base_settings, partitions=3)
    await create_topics(settings)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
    await producer.start()
    topic = settings.topic("outputs_delivered")
    try:
        for partition, ops in enumerate((["a0", "a1", "a2"], ["b0", "b1"], ["c0"])):
            for op in ops:
                await producer.send_and_wait(topic, orjson.dumps(output(op, op)), partition=partition)
        await producer.send_and_wait(topic, b"not an output event", partition=0)  # skipped, not counted
        tps = [TopicPartition(topic, p) for p in range(3)]
        dedupe, done = EventDeduplicator(), list[TopicPartition]()
        learned = await learn_event_ids(settings, {tps[0]: 4, tps[1]: 1, tps[2]: 5}, dedupe, done.append)
        assert learned == {tps[0]: 3, tps[1]: 1, tps[2]: 0}  # partition 2 ends before offset 5: nothing learned
        assert sorted(done) == tps
        seen = [op for op in ("a0", "a1", "a2", "b0", "b1", "c0") if not dedupe.first_time(f"output:{op}:out_0")]
        assert seen == ["a0", "a1", "a2", "b0"]
    finally:
        await producer.stop()
        await delete_topics(settings)
