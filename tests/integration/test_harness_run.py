"""The run steps the main job and the soak share (streams_harness.run), against the real PostgreSQL and Kafka:
a run's own database and topics, created and removed; the replay with its progress and its ways to end."""

from __future__ import annotations

import io
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from streams.clients.follow import read_topic_to_end
from streams.config import Settings
from streams.errors import StreamsError
from streams.ledger.pool import create_pool
from streams.setup.admin import delete_topics, migrations_line
from streams_harness import run
from streams_harness.run import RunOptions, isolated_run, replay_until_final
from streams_harness.services import drop_run_database
from streams_harness.trace import read_trace

pytestmark = pytest.mark.integration


async def topics(settings: Settings) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        return {t for t in await admin.list_topics() if t.startswith(settings.topic_prefix)}
    finally:
        await admin.close()


async def database_exists(settings: Settings, name: str) -> bool:
    conn = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        return bool(await conn.fetchval("SELECT count(*) FROM pg_database WHERE datname = $1", name))
    finally:
        await conn.close()


def run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def database_name(settings: Settings) -> str:
    return settings.database_url.get_secret_value().rpartition("/")[2]


#: The ids of the repository's migrations, in order (``migrations/*.sql``, rollbacks excluded).
MIGRATION_IDS = sorted(
    p.stem for p in (Path(__file__).parents[2] / "migrations").glob("*.sql") if ".rollback" not in p.name
)


async def test_a_run_has_its_own_migrated_database_and_topics_removed_afterwards(base_settings: Settings) -> None:
    out = io.StringIO()
    async with isolated_run(base_settings, run_id(), keep=False, out=out) as settings:
        name = database_name(settings)
        assert await database_exists(base_settings, name)
        conn = await asyncpg.connect(settings.database_url.get_secret_value())
        try:
            assert await conn.fetchval("SELECT count(*) FROM operations") == 0  # migrated
        finally:
            await conn.close()
        assert await topics(settings) == set(settings.topics.values())
    assert not await database_exists(base_settings, name)
    assert await topics(settings) == set()
    assert out.getvalue().splitlines() == [f"run database {name}: {migrations_line(MIGRATION_IDS)}"]


async def test_a_runs_migrations_are_one_line_without_yoyos_info_log(
    base_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="yoyo")  # as `streams run` logs: INFO
    out = io.StringIO()
    async with isolated_run(base_settings, run_id(), keep=False, out=out) as settings:
        conn = await asyncpg.connect(settings.database_url.get_secret_value())
        try:
            applied = await conn.fetchval("SELECT count(*) FROM _yoyo_migration")
        finally:
            await conn.close()
    assert applied == len(MIGRATION_IDS) > 1
    assert [r.getMessage() for r in caplog.records if r.name.startswith("yoyo")] == []
    assert out.getvalue() == (
        f"run database {database_name(settings)}: migrations applied: {applied} "
        f"({MIGRATION_IDS[0]} .. {MIGRATION_IDS[-1]})\n"
    )
    assert logging.getLogger("yoyo").level == logging.INFO  # given back


async def test_keep_leaves_database_and_topics(base_settings: Settings) -> None:
    async with isolated_run(base_settings, run_id(), keep=True, out=io.StringIO()) as settings:
        pass
    try:
        assert await database_exists(base_settings, database_name(settings))
        assert await topics(settings) == set(settings.topics.values())
    finally:
        await delete_topics(settings)
        await drop_run_database(base_settings.database_url.get_secret_value(), settings.database_url.get_secret_value())


async def test_a_removal_that_fails_is_said_and_the_runs_own_error_raised(
    base_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(settings: Settings) -> None:
        raise OSError("connection refused")

    monkeypatch.setattr(run, "delete_topics", refused)
    out = io.StringIO()
    with pytest.raises(ValueError, match="the run's own failure"):
        async with isolated_run(base_settings, run_id(), keep=False, out=out) as settings:
            raise ValueError("the run's own failure")
    assert out.getvalue().splitlines()[1:] == [
        f"warning: the run's topics {settings.topic_prefix}* not removed (OSError: connection refused); "
        "remove it by hand"
    ]
    assert not await database_exists(base_settings, database_name(settings))  # the next removal still ran
    await delete_topics(settings)


@pytest.fixture
async def isolated(base_settings: Settings) -> AsyncIterator[tuple[Settings, asyncpg.Pool, str]]:
    rid = run_id()
    async with isolated_run(base_settings, rid, keep=False, out=io.StringIO()) as settings:
        pool = await create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=2)
        try:
            yield settings, pool, rid
        finally:
            await pool.close()


async def test_the_replay_ends_at_the_timeout_with_what_was_sent(isolated: tuple[Settings, asyncpg.Pool, str]) -> None:
    settings, pool, rid = isolated
    rows = read_trace("conv", rows=3)
    out = io.StringIO()
    opts = RunOptions(compression=1000.0, timeout_s=1.0)
    ids, elapsed_s = await replay_until_final(
        settings, pool, rows, opts, rid, out=out, interval_s=0.3, extra=lambda: "  (extra)"
    )
    assert ids == [f"{rid}-conv-000000", f"{rid}-conv-000001", f"{rid}-conv-000002"]
    assert 1.0 < elapsed_s < 5.0
    lines = out.getvalue().splitlines()
    assert lines[-1] == "timeout after 1 s: reporting what is there"
    assert lines[-2].endswith("submitted 3/3  final 0/3  (0 ops/s)  outbox pending 0  |   (extra)")  # no worker runs
    published = await read_topic_to_end(settings, "submissions")
    assert sorted(r.value["operation_id"] for r in published) == ids


async def test_a_process_that_died_ends_the_replay(isolated: tuple[Settings, asyncpg.Pool, str]) -> None:
    settings, pool, rid = isolated

    def check() -> None:
        raise StreamsError("the simulator exited; see simulator.log")

    with pytest.raises(StreamsError, match="the simulator exited"):
        await replay_until_final(
            settings, pool, read_trace("conv", rows=2000), RunOptions(timeout_s=60.0), rid, out=io.StringIO(),
            interval_s=0.2, check=check,
        )  # fmt: skip


async def test_an_outage_of_the_progress_read_is_said_and_waited_out(
    isolated: tuple[Settings, asyncpg.Pool, str],
) -> None:
    settings, _, rid = isolated
    closed = await create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=1)
    await closed.close()  # every statement now fails as on a broken connection
    out = io.StringIO()
    ids, _ = await replay_until_final(
        settings, closed, read_trace("conv", rows=1), RunOptions(timeout_s=0.5), rid, out=out, interval_s=0.2
    )
    assert len(ids) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("progress not read: InterfaceError: pool is closed")
    assert lines[-1] == "timeout after 0 s: reporting what is there"


async def test_a_progress_read_that_is_no_outage_ends_the_replay(
    isolated: tuple[Settings, asyncpg.Pool, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, pool, rid = isolated

    async def broken(db: object, pattern: str) -> dict[str, int]:
        raise KeyError("state")  # a bug, not PostgreSQL restarting

    monkeypatch.setattr(run, "progress", broken)
    with pytest.raises(KeyError, match="state"):
        await replay_until_final(
            settings, pool, read_trace("conv", rows=1), RunOptions(timeout_s=60.0), rid, out=io.StringIO(),
            interval_s=0.2,
        )  # fmt: skip
