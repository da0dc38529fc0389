"""Harness set-up on the shared services: a run's own database (created and dropped next to the configured
one) and waiting for a run's consumer group to settle. The product never uses these (:mod:`streams.setup.admin`
holds what it does).
"""

from __future__ import annotations

import asyncio

from tenacity import AsyncRetrying, retry_if_result, stop_before_delay, wait_fixed

from streams.config import Settings
from streams.ledger.pool import connect
from streams.setup.admin import KafkaAdmin, database_name

#: Seconds between two looks at a consumer group that is not stable yet (:func:`wait_group_stable`).
GROUP_LOOK_INTERVAL_S = 0.25


async def create_run_database(database_url: str, run_id: str) -> str:
    """Create an empty database ``<name>_<run_id>`` next to ``database_url``'s and return its URL.

    Harness runs (main job, soak) use one each, so an aborted run's leftovers never reach the next run's
    workers.

    Raises:
        DatabaseConfigError: PostgreSQL refused the login, or has no database ``database_url`` names.
        LedgerUnavailableError: PostgreSQL did not accept the connection.
        asyncpg.PostgresError: the role may not create databases.
    """
    base, _, name = database_url.rpartition("/")
    name, _, query = name.partition("?")
    run_db = f"{name}_{run_id}".lower()
    conn = await connect(database_url)
    try:
        await conn.execute(f'CREATE DATABASE "{run_db}"')
    finally:
        await conn.close()
    return f"{base}/{run_db}" + (f"?{query}" if query else "")


async def drop_run_database(database_url: str, run_database_url: str) -> None:
    """Drop the run database created by :func:`create_run_database` (its connections are terminated).

    Raises:
        as :func:`streams.ledger.pool.connect`.
    """
    run_db = database_name(run_database_url)
    conn = await connect(database_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{run_db}" WITH (FORCE)')
    finally:
        await conn.close()


async def wait_group_stable(settings: Settings, members: int, timeout_s: float) -> bool:
    """Wait until the consumer group ``settings.app_id`` is ``Stable`` with at least ``members`` members, looking
    every :data:`GROUP_LOOK_INTERVAL_S` (tenacity) while it is not.

    Returns False when the group did not settle within ``timeout_s`` (the caller decides whether that matters).
    Retriable broker errors (a new broker without a group coordinator yet) are retried within the same time.

    Raises:
        KafkaAdminError: the broker could not describe the group at all within ``timeout_s``, or refused.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with KafkaAdmin(settings, deadline_s=timeout_s) as admin:

        async def stable() -> bool:
            group = await admin.describe_group(settings.app_id, deadline_s=deadline - loop.time())
            return group.state == "Stable" and group.members >= members

        left_s = deadline - loop.time()
        if left_s <= 0:
            return False
        retrying = AsyncRetrying(
            retry=retry_if_result(lambda is_stable: not is_stable),
            wait=wait_fixed(GROUP_LOOK_INTERVAL_S),
            stop=stop_before_delay(left_s),  # no look would start after the deadline
            retry_error_callback=lambda _: False,
        )
        return bool(await retrying(stable))
