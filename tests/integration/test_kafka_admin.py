"""Kafka admin calls and readiness checks against the real services (a brand-new broker: test_fresh_broker.py)."""

from __future__ import annotations

import time
import uuid

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import InvalidTopicError, KafkaConnectionError

from streams.config import Settings
from streams.errors import DatabaseConfigError, KafkaAdminError, ServiceNotReadyError
from streams.setup.admin import KafkaAdmin, create_topics, delete_topics
from streams.setup.readiness import wait_ready
from streams_harness.bench.runner import RUN_TOPIC_CONFIGS
from streams_harness.fleet import free_port
from streams_harness.services import wait_group_stable
from tests.support import unique_settings

pytestmark = pytest.mark.integration


async def test_topics_are_created_once_and_deleted_once(base_settings: Settings) -> None:
    settings = unique_settings(base_settings, partitions=3)
    names = list(settings.topics.values())
    try:
        assert sorted(await create_topics(settings)) == sorted(names)
        assert await create_topics(settings) == []
        async with KafkaAdmin(settings) as admin:
            [response] = await admin.call("describe", lambda client: client.describe_topics(names[:1]))
        assert response["topic"] == names[0] and len(response["partitions"]) == 3
    finally:
        assert sorted(await delete_topics(settings)) == sorted(names)
    assert await delete_topics(settings) == []


async def test_topic_configs_are_set_on_the_topics_created(base_settings: Settings) -> None:
    """streams bench gives its runs' topics smaller index files (streams_harness/bench/runner.py RUN_TOPIC_CONFIGS);
    the broker keeps them, beside min.insync.replicas, and a config it does not know is refused."""
    settings = unique_settings(base_settings, partitions=1).replace(kafka_min_insync_replicas=1)
    names = list(settings.topics.values())
    try:
        await create_topics(settings, topic_configs=RUN_TOPIC_CONFIGS)
        async with KafkaAdmin(settings) as admin:
            for name in names:
                configs = await admin.describe_topic_configs(name, ["segment.index.bytes", "min.insync.replicas"])
                assert configs == {"segment.index.bytes": "1048576", "min.insync.replicas": "1"}
            with pytest.raises(KafkaAdminError, match=r"no\.such\.config"):
                await admin.create_topics([f"{names[0]}-x"], 1, topic_configs={"no.such.config": "1"})
    finally:
        await delete_topics(settings)


async def test_a_topic_the_broker_refuses_is_an_error_not_a_silent_success(base_settings: Settings) -> None:
    """The broker answers CreateTopics with a per-topic error code; it used to be dropped on the floor."""
    settings = base_settings.replace(kafka_admin_deadline_s=20)
    async with KafkaAdmin(settings) as admin:
        started = time.monotonic()
        with pytest.raises(KafkaAdminError) as caught:
            await admin.create_topics([f"bad name {uuid.uuid4().hex[:6]}"], partitions=1)
    assert time.monotonic() - started < 5  # a definite answer: not retried until the deadline
    assert isinstance(caught.value.cause, InvalidTopicError)
    assert caught.value.attempts == 1 and "create topics ['bad name" in str(caught.value)


async def test_an_unreachable_broker_is_retried_until_the_deadline(base_settings: Settings) -> None:
    settings = base_settings.replace(kafka_bootstrap=f"127.0.0.1:{free_port()}", kafka_admin_deadline_s=2.0)
    started = time.monotonic()
    with pytest.raises(KafkaAdminError) as caught:
        await create_topics(settings)
    elapsed = time.monotonic() - started
    assert 2.0 <= elapsed < 8.0
    assert caught.value.call == "connect" and caught.value.attempts >= 3
    assert isinstance(caught.value.cause, KafkaConnectionError)
    assert settings.kafka_bootstrap in str(caught.value)


async def test_group_description_and_stability_of_a_real_consumer_group(base_settings: Settings) -> None:
    settings = unique_settings(base_settings, partitions=2)
    await create_topics(settings)
    consumer = AIOKafkaConsumer(
        settings.topic("submissions"), bootstrap_servers=settings.kafka_bootstrap, group_id=settings.app_id
    )
    try:
        async with KafkaAdmin(settings) as admin:
            before = await admin.describe_group(settings.app_id)
            assert (before.state, before.members) == ("Dead", 0)  # unknown group: nothing created by describing it
            assert await admin.find_coordinator(settings.app_id) == 1  # the only broker (node.id=1, scripts/services)
        await consumer.start()
        assert await wait_group_stable(settings, members=1, timeout_s=30) is True
        async with KafkaAdmin(settings) as admin:
            after = await admin.describe_group(settings.app_id)
        assert (after.state, after.members) == ("Stable", 1)
        assert await wait_group_stable(settings, members=2, timeout_s=1.5) is False
    finally:
        await consumer.stop()
        await delete_topics(settings)


async def test_ready_answers_for_the_three_services(base_settings: Settings) -> None:
    settings = unique_settings(base_settings)
    answers = await wait_ready(settings, ["postgres", "redis", "kafka"], deadline_s=30)
    assert answers["postgres"][0].startswith("PostgreSQL ")
    assert answers["redis"][0].startswith("Redis ")
    assert answers["kafka"][0].startswith("group coordinator: broker ")
    assert all(0 <= elapsed_s < 30 for _, elapsed_s in answers.values())
    client = aioredis.from_url(settings.redis_url.get_secret_value())
    try:
        assert [key async for key in client.scan_iter(f"{settings.lease_key_prefix}:*")] == []  # probe key deleted
    finally:
        await client.aclose()


async def test_ready_refusals_and_silence_say_which_service_and_why(base_settings: Settings) -> None:
    wrong_password = base_settings.replace(database_url="postgresql://streams:wrong@127.0.0.1:5432/streams")
    started = time.monotonic()
    with pytest.raises(DatabaseConfigError, match="refused the login: password authentication failed"):
        await wait_ready(wrong_password, ["postgres"], deadline_s=20)
    assert time.monotonic() - started < 5  # a refusal is not retried

    nobody = base_settings.replace(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    with pytest.raises(ServiceNotReadyError) as caught:
        await wait_ready(nobody, ["redis"], deadline_s=1.5)
    assert 1.5 <= time.monotonic() - started < 6
    assert caught.value.service == "redis" and "did not answer SET/GET within 2 s" in str(caught.value)
