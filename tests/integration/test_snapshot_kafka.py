"""The live view's Kafka figures (``streams.oncall.snapshot.KafkaFigures``) on the real broker: the workers' lag per
consumed topic from the group's committed offsets (none committed: every record kept), the dead letters kept."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from streams.config import Settings
from streams.oncall.snapshot import KafkaFigures
from streams.setup.admin import create_topics, delete_topics
from tests.support import unique_settings, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
async def own_topics(migrated: Settings) -> AsyncIterator[Settings]:
    """Settings with this test's own topics (created, then deleted) and consumer group."""
    settings = unique_settings(migrated, partitions=2)
    await create_topics(settings)
    try:
        yield settings
    finally:
        await delete_topics(settings)


async def test_the_lag_counts_from_the_committed_offsets_and_from_the_first_record_without_them(
    own_topics: Settings,
) -> None:
    settings = own_topics
    submissions, polls = settings.topic("submissions"), settings.topic("polls")
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(5):
            await producer.send_and_wait(submissions, b"{}", partition=i % 2)
        await producer.send_and_wait(settings.topic("dead_letter"), b"{}", partition=0)
    finally:
        await producer.stop()
    figures = KafkaFigures(settings)
    read: list[tuple[dict[str, int], dict[str, Any]]] = []

    async def answered() -> bool:  # a fresh group's coordinator may still be loading: a failed read, said so
        try:
            read.append(await figures.read())
        except KafkaError:
            return False
        return True

    try:
        await wait_for(answered, 30.0, "the live view's Kafka figures")
        lag, dead_letters = read[-1]
        assert lag == {submissions: 5, polls: 0}  # the group committed nothing: every record kept is behind
        assert dead_letters["retained"] == 1
        group = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap, group_id=settings.app_id, enable_auto_commit=False
        )
        await group.start()
        try:
            group.assign([TopicPartition(submissions, 0)])
            await group.commit({TopicPartition(submissions, 0): OffsetAndMetadata(2, "")})
        finally:
            await group.stop()
        read.clear()
        await wait_for(answered, 30.0, "the live view's Kafka figures after the commit")
        lag, _ = read[-1]
        assert lag == {submissions: 3, polls: 0}  # partition 0: 3 records, 2 consumed; partition 1: 2, none
    finally:
        await figures.close()
