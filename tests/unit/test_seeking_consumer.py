"""The worker's consumer seeks a partition nothing was committed on back to offset 0 when Faust seeks to the
committed offsets (:class:`streams.worker.app._SeekingConsumer`): aiokafka's ``seek_to_committed`` leaves it
where the fetch stopped, past the records Faust dropped during a rebalance."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from faust.transport.drivers.aiokafka import Consumer as FaustKafkaConsumer
from faust.types import TP

from streams.worker import app as worker_app


async def test_partitions_without_a_committed_offset_are_sought_to_0(monkeypatch: pytest.MonkeyPatch) -> None:
    committed: dict[TP, int | None] = {TP("s", 0): 12, TP("s", 8): None, TP("s", 9): 0}
    sought: list[Mapping[TP, int]] = []

    async def seek_to_committed(self: Any) -> Mapping[TP, int | None]:
        return committed

    async def seek_wait(self: Any, partitions: Mapping[TP, int]) -> None:
        sought.append(dict(partitions))

    monkeypatch.setattr(FaustKafkaConsumer, "seek_to_committed", seek_to_committed)
    monkeypatch.setattr(FaustKafkaConsumer, "seek_wait", seek_wait)
    consumer = object.__new__(worker_app._SeekingConsumer)
    assert await consumer.seek_to_committed() == committed
    assert sought == [{TP("s", 8): 0, TP("s", 9): 0}]


async def test_nothing_is_sought_again_when_every_partition_has_a_committed_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sought: list[Mapping[TP, int]] = []

    async def seek_to_committed(self: Any) -> Mapping[TP, int]:
        return {TP("s", 0): 3}

    async def seek_wait(self: Any, partitions: Mapping[TP, int]) -> None:
        sought.append(dict(partitions))

    monkeypatch.setattr(FaustKafkaConsumer, "seek_to_committed", seek_to_committed)
    monkeypatch.setattr(FaustKafkaConsumer, "seek_wait", seek_wait)
    consumer = object.__new__(worker_app._SeekingConsumer)
    await consumer.seek_to_committed()
    assert sought == []


def test_the_app_makes_the_seeking_consumer(base_settings: Any) -> None:
    app = worker_app.create_app(base_settings.replace(web_enabled=False))
    assert isinstance(app.consumer, worker_app._SeekingConsumer)
