"""Set-up tasks: apply migrations (yoyo-migrations) and create the Kafka topics.

Migrations are the plain SQL files in ``migrations/`` (installed as the package ``streams.migrations``); yoyo
applies them in order and records each in its ``_yoyo_migration`` table, under a lock, so concurrent callers
are safe.
"""

from __future__ import annotations

import asyncio
import logging
from importlib import resources
from pathlib import Path

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from yoyo import get_backend, read_migrations
from yoyo.migrations import MigrationList

from streams.config import Settings
from streams.errors import MissingResourceError

log = logging.getLogger(__name__)

#: The package that holds the migrations (``migrations/`` of the repository, see ``pyproject.toml``).
MIGRATIONS_PACKAGE = "streams.migrations"


def yoyo_url(database_url: str) -> str:
    """The yoyo backend URL (psycopg 3 driver) for a ``postgresql://`` URL."""
    scheme, sep, rest = database_url.partition("://")
    if not sep or not scheme.startswith("postgres"):
        raise ValueError(f"not a PostgreSQL URL: {database_url!r}")
    return f"postgresql+psycopg://{rest}"


def sql_migrations(directory: Path) -> MigrationList:
    """The SQL migrations (``*.sql``, rollbacks paired by yoyo) of ``directory``.

    Raises:
        MissingResourceError: the directory holds none; an installation without its migrations must not
            report a database as up to date.
    """
    found = read_migrations(str(directory))
    migrations = MigrationList([m for m in found if m.path.endswith(".sql")], found.post_apply)
    if not migrations:
        raise MissingResourceError(
            f"no migration (*.sql) found in {directory}: the installed package {MIGRATIONS_PACKAGE} is incomplete; "
            "reinstall generation-streams. Nothing was applied."
        )
    return migrations


def migrate(database_url: str) -> list[str]:
    """Apply pending migrations of :data:`MIGRATIONS_PACKAGE`; returns the ids applied (empty when up to date).

    Raises:
        MissingResourceError: the package is not installed or holds no migration (nothing is applied).
    """
    try:
        package = resources.files(MIGRATIONS_PACKAGE)
    except ModuleNotFoundError as exc:
        raise MissingResourceError(
            f"package {MIGRATIONS_PACKAGE} is not installed: reinstall generation-streams. Nothing was applied."
        ) from exc
    with resources.as_file(package) as directory:
        migrations = sql_migrations(directory)
        backend = get_backend(yoyo_url(database_url))
        with backend.lock():
            pending = backend.to_apply(migrations)
            backend.apply_migrations(pending)
    return [m.id for m in pending]


async def create_topics(settings: Settings) -> list[str]:
    """Create the five topics with ``settings.partitions`` partitions (replication 1); returns those created.

    Existing topics are left as they are (their partition count is not changed).
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [name for name in settings.topics.values() if name not in existing]
        if wanted:
            try:
                await admin.create_topics(
                    [NewTopic(name, num_partitions=settings.partitions, replication_factor=1) for name in wanted]
                )
            except TopicAlreadyExistsError:
                pass
        return wanted
    finally:
        await admin.close()


async def delete_topics(settings: Settings) -> list[str]:
    """Delete the five topics of ``settings`` (those that exist); returns the names deleted.

    Meant for isolated runs (the main job, test sessions) whose topics carry their own prefix.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        doomed = [name for name in settings.topics.values() if name in existing]
        if doomed:
            await admin.delete_topics(doomed)
        return doomed
    finally:
        await admin.close()


async def create_run_database(database_url: str, run_id: str) -> str:
    """Create an empty database ``<name>_<run_id>`` next to ``database_url``'s and return its URL.

    Harness runs (main job, soak) use one each, so an aborted run's leftovers never reach the next run's
    workers. Raises ``asyncpg.PostgresError`` when the role may not create databases.
    """
    base, _, name = database_url.rpartition("/")
    name, _, query = name.partition("?")
    run_db = f"{name}_{run_id}".lower()
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f'CREATE DATABASE "{run_db}"')
    finally:
        await conn.close()
    return f"{base}/{run_db}" + (f"?{query}" if query else "")


async def drop_run_database(database_url: str, run_database_url: str) -> None:
    """Drop the run database created by :func:`create_run_database` (its connections are terminated)."""
    run_db = run_database_url.rpartition("/")[2].partition("?")[0]
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{run_db}" WITH (FORCE)')
    finally:
        await conn.close()


async def wait_group_stable(settings: Settings, members: int, timeout_s: float) -> bool:
    """Wait until the consumer group ``settings.app_id`` is ``Stable`` with ``members`` members.

    Returns False when the time ran out (the caller decides whether that matters).
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            [response] = await admin.describe_consumer_groups([settings.app_id])
            group = response.groups[0]
            state, group_members = group[2], group[5]
            if state == "Stable" and len(group_members) >= members:
                return True
            await asyncio.sleep(0.25)
        return False
    finally:
        await admin.close()
