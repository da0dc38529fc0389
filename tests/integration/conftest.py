"""Fixtures of the integration tier: real PostgreSQL, Redis, Kafka and the simulator on a real socket."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from streams.config import Settings
from streams.coordination.lease import LeaseManager, make_redis
from streams.ledger.pool import create_pool
from streams.ledger.store import Ledger
from streams.remote.client import RemoteClient
from streams.setup.admin import create_topics, delete_topics, migrate
from streams.worker.runtime import Runtime
from streams_harness.simulator import SimulatorConfig
from tests.support import LEDGER_TABLES
from tests.support import SimulatorServer as Simulator

pytestmark = pytest.mark.integration

TABLES = LEDGER_TABLES


@pytest.fixture(scope="session")
def migrated(base_settings: Settings) -> Iterator[Settings]:
    """The test database migrated and the session's topics created (and deleted at the end)."""
    migrate(base_settings.database_url.get_secret_value())
    asyncio.run(create_topics(base_settings))
    yield base_settings
    asyncio.run(delete_topics(base_settings))


@pytest.fixture
async def pool(migrated: Settings) -> AsyncIterator[asyncpg.Pool]:
    """A pool on the test database, with every ledger table emptied first."""
    p = await create_pool(migrated.database_url.get_secret_value(), min_size=1, max_size=10)
    await p.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    yield p
    await p.close()


@pytest.fixture
async def simulator() -> AsyncIterator[Simulator]:
    """The provider simulator on a real loopback port, faults off, 100x compressed."""
    sim = Simulator()
    await sim.start(SimulatorConfig(port=0, compression=100.0, get_latency_ms=1.0))
    yield sim
    await sim.stop()


@pytest.fixture
async def kafka_admin(migrated: Settings) -> AsyncIterator[AIOKafkaAdminClient]:
    """A started Kafka admin client of the test's cluster."""
    admin = AIOKafkaAdminClient(bootstrap_servers=migrated.kafka_bootstrap)
    await admin.start()
    yield admin
    await admin.close()


@pytest.fixture
async def one_partition_topic(migrated: Settings, kafka_admin: AIOKafkaAdminClient) -> AsyncIterator[str]:
    """The name of a topic of one partition made for this test under the run's prefix, deleted after it."""
    topic = f"{migrated.topic_prefix}t-{uuid.uuid4().hex[:8]}"
    await kafka_admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    yield topic
    await kafka_admin.delete_topics([topic])


@pytest.fixture
async def kafka_send(migrated: Settings) -> AsyncIterator[Callable[[str, bytes, bytes], Awaitable[Any]]]:
    """A real Kafka producer as the runtime's send function (waits for acks)."""
    producer = AIOKafkaProducer(bootstrap_servers=migrated.kafka_bootstrap, acks="all")
    await producer.start()

    async def send(topic: str, key: bytes, value: bytes) -> Any:
        return await producer.send_and_wait(topic, value, key=key)

    yield send
    await producer.stop()


@pytest.fixture
def settings(migrated: Settings, simulator: Simulator) -> Settings:
    """Per-test settings: the simulator's URL and a fresh Redis key prefix."""
    return migrated.replace(remote_base_url=simulator.url, lease_key_prefix=f"t{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def runtime(
    settings: Settings, pool: asyncpg.Pool, kafka_send: Callable[[str, bytes, bytes], Awaitable[Any]]
) -> AsyncIterator[Runtime]:
    """A worker runtime over the real services (its own pool, Redis client and HTTP client)."""
    rt = await Runtime.create(settings, kafka_send, worker="test-worker")
    yield rt
    await rt.close()


@pytest.fixture
async def ledger(pool: asyncpg.Pool) -> Ledger:
    return Ledger(pool, "test")


@pytest.fixture
async def leases(settings: Settings) -> AsyncIterator[LeaseManager]:
    client = make_redis(
        settings.redis_url.get_secret_value(),
        settings.redis_socket_timeout_s,
        connect_timeout_s=settings.redis_connect_timeout_s,
        max_connections=settings.redis_max_connections,
        pool_timeout_s=settings.redis_pool_timeout_s,
    )
    yield LeaseManager(client, settings.lease_ttl_ms)
    await client.aclose()


@pytest.fixture
async def remote(settings: Settings) -> AsyncIterator[RemoteClient]:
    client = RemoteClient.from_settings(settings)
    yield client
    await client.aclose()
