"""``streams teardown`` against the real services: a kept run's database, topics and consumer group are removed,
each named on the way; the shared names are refused."""

from __future__ import annotations

import uuid

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from streams.config import Settings
from streams.setup.admin import create_topics, database_name
from streams.setup.teardown import run_names
from streams_harness.services import create_run_database
from tests.integration.operators_support import streams_cli

pytestmark = pytest.mark.integration


async def _topics_and_groups(settings: Settings) -> tuple[set[str], set[str]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics()), {g[0] for g in await admin.list_consumer_groups()}
    finally:
        await admin.close()


async def _database_exists(settings: Settings, name: str) -> bool:
    conn = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name))
    finally:
        await conn.close()


async def test_teardown_of_a_run_id_removes_its_database_topics_and_group(migrated: Settings) -> None:
    run_id = f"td{uuid.uuid4().hex[:8]}"
    names = run_names(migrated, run_id)
    run_url = await create_run_database(migrated.database_url.get_secret_value(), run_id)
    assert database_name(run_url) == names.database
    run = migrated.replace(database_url=run_url, topic_prefix=names.topic_prefix, app_id=names.groups[0])
    await create_topics(run)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=migrated.kafka_bootstrap, group_id=run.app_id, enable_auto_commit=False
    )
    partition = TopicPartition(run.topic("submissions"), 0)
    consumer.assign([partition])
    await consumer.start()
    try:  # a group with committed offsets, as a run's workers leave it
        await consumer.commit({partition: 0})
    finally:
        await consumer.stop()
    topics, groups = await _topics_and_groups(migrated)
    assert set(run.topics.values()) <= topics and run.app_id in groups

    dry = await streams_cli(migrated, "teardown", "--run-id", run_id, "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert f"would remove database {names.database}" in dry.stdout
    assert await _database_exists(migrated, str(names.database))

    done = await streams_cli(migrated, "teardown", "--run-id", run_id)
    assert done.exit_code == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"removed consumer group {run.app_id}"
    n = len(run.topics)
    assert sorted(lines[1 : 1 + n]) == sorted(f"removed topic {t}" for t in run.topics.values())
    assert lines[1 + n] == f"removed database {names.database}"
    assert lines[2 + n] == f"removed {2 + n} (nothing else matched)"  # the group, the topics, the database
    topics, groups = await _topics_and_groups(migrated)
    assert not {t for t in topics if t.startswith(str(names.topic_prefix))}
    assert run.app_id not in groups
    assert not await _database_exists(migrated, str(names.database))
    assert set(migrated.topics.values()) <= topics  # the session's own topics stay

    again = await streams_cli(migrated, "teardown", "--run-id", run_id)
    assert again.exit_code == 0 and again.stdout == "removed 0 (nothing else matched)\n"


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--topic-prefix", ""], "unprefixed, shared"),
        (["--topic-prefix", "generation."], "unprefixed, shared"),
        (["--database", "{ledger}"], "it is the ledger"),
    ],
)
async def test_teardown_refuses_the_shared_names(migrated: Settings, args: list[str], names: str) -> None:
    ledger = database_name(migrated.database_url.get_secret_value())
    result = await streams_cli(migrated, "teardown", *[a.format(ledger=ledger) for a in args])
    assert result.exit_code == 3, (result.stdout, result.stderr)
    assert names in result.stderr and "Nothing was removed" in result.stderr
    assert result.stdout == ""
    assert await _database_exists(migrated, ledger)
    topics, _ = await _topics_and_groups(migrated)
    assert set(migrated.topics.values()) <= topics
