"""A brand-new Kafka broker answers on its port before it can coordinate a consumer group (its
``__consumer_offsets`` topic is created on the first coordinator look-up). These tests start a throwaway broker
beside the shared one, as a first run on a fresh machine does, and check that the project copes."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from streams.config import Settings
from streams.setup.admin import create_topics
from streams_harness.services import wait_group_stable
from tests.support import ThrowawayBroker, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ThrowawayBroker]:
    b = ThrowawayBroker(tmp_path / "data")
    yield b
    b.stop()


async def test_admin_calls_wait_for_the_coordinator_of_a_broker_that_only_answers_its_port(
    broker: ThrowawayBroker, base_settings: Settings
) -> None:
    """The main job's first-run crash: the consumer group is described on a broker with no coordinator yet."""
    broker.start("--no-wait")
    settings = base_settings.replace(kafka_bootstrap=broker.bootstrap, app_id=f"fresh-{uuid.uuid4().hex[:8]}")
    assert sorted(await create_topics(settings)) == sorted(settings.topics.values())
    stable = asyncio.create_task(wait_group_stable(settings, members=1, timeout_s=60))

    async def first_lookup_made() -> bool:  # the broker creates __consumer_offsets on the first look-up
        return stable.done() or "auto-creation request for [__consumer_offsets]" in broker.log_path.read_text()

    await wait_for(first_lookup_made, 30, "the first group coordinator look-up")
    consumer = AIOKafkaConsumer(
        settings.topic("submissions"), bootstrap_servers=broker.bootstrap, group_id=settings.app_id
    )
    await consumer.start()
    try:
        assert await stable is True
    finally:
        await consumer.stop()


async def test_services_start_returns_once_a_consumer_group_can_be_coordinated(broker: ThrowawayBroker) -> None:
    broker.start()
    # aiokafka's plain admin client, which does not retry: it works at once after `start` returned.
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        group_id = f"fresh-{uuid.uuid4().hex[:8]}"
        assert await admin.find_coordinator(group_id) == 1  # node.id of the single-node cluster
        [response] = await admin.describe_consumer_groups([group_id])
        error_code, group, state, *_ = response.groups[0]
        assert (error_code, group, state) == (0, group_id, "Dead")
    finally:
        await admin.close()


def test_a_broker_that_dies_while_starting_fails_start_at_once_with_its_log(broker: ThrowawayBroker) -> None:
    with socket.socket() as taken:  # the controller's port is taken: the broker exits during start-up
        taken.bind(("127.0.0.1", broker.port + 1))
        taken.listen()
        started = time.monotonic()
        done = broker.services("start", "kafka")
    assert done.returncode != 0
    assert time.monotonic() - started < 60  # not the 120 s readiness deadline
    assert "exited" in done.stderr and str(broker.log_path) in done.stderr
