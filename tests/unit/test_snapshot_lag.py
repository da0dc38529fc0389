"""The live view's lag (``streams.oncall.snapshot.KafkaFigures``) over a declared stand-in of aiokafka's admin
client and consumer: the consumed partitions are named in the offsets request, and an answer missing one (aiokafka
drops a group-level error: the coordinator loading) is a failed read, never "nothing committed"."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import CoordinatorLoadInProgressError
from aiokafka.structs import OffsetAndMetadata

from streams.config import Settings
from streams.oncall.snapshot import CONSUMED_ROLES, KafkaFigures


class Admin:
    """The admin client's calls KafkaFigures makes; ``offsets`` answers every offsets request."""

    def __init__(self, settings: Settings, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        self.topics = [settings.topic(r) for r in (*CONSUMED_ROLES, "dead_letter")]
        self.offsets = offsets
        self.asked: list[list[TopicPartition] | None] = []
        self.closed = False

    async def list_topics(self) -> list[str]:
        return self.topics

    async def describe_topics(self, topics: list[str]) -> list[dict[str, Any]]:
        return [{"topic": t, "partitions": [{"partition": 0}, {"partition": 1}]} for t in topics]

    async def list_consumer_group_offsets(
        self, group_id: str, partitions: list[TopicPartition] | None = None
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        self.asked.append(partitions)
        return self.offsets

    async def close(self) -> None:
        self.closed = True


class Consumer:
    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: 10 for tp in tps}

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: 4 for tp in tps}

    async def stop(self) -> None:
        pass


def figures_with(settings: Settings, admin: Admin) -> KafkaFigures:
    figures = KafkaFigures(settings)
    figures._admin, figures._consumer = admin, Consumer()
    return figures


async def test_the_consumed_partitions_are_named_and_a_partition_without_a_commit_counts_from_its_first_record() -> (
    None
):
    settings = Settings()
    submissions, polls = settings.topic("submissions"), settings.topic("polls")
    offsets = {
        TopicPartition(submissions, 0): OffsetAndMetadata(7, ""),
        TopicPartition(submissions, 1): OffsetAndMetadata(-1, ""),  # none committed
        TopicPartition(polls, 0): OffsetAndMetadata(10, ""),
        TopicPartition(polls, 1): OffsetAndMetadata(10, ""),
    }
    admin = Admin(settings, offsets)
    lag, dead_letters = await figures_with(settings, admin).read()
    assert lag == {submissions: 3 + 6, polls: 0}
    assert dead_letters["retained"] == 12
    assert admin.asked == [[TopicPartition(t, p) for t in (submissions, polls) for p in (0, 1)]]


async def test_an_answer_without_the_groups_offsets_is_a_failed_read_not_every_record_as_lag() -> None:
    settings = Settings()
    admin = Admin(settings, {})  # what aiokafka returns when it dropped a group-level error
    with pytest.raises(CoordinatorLoadInProgressError, match="no committed offsets of group"):
        await figures_with(settings, admin).read()
    assert admin.closed  # the clients are closed after a failed read and opened again next time
