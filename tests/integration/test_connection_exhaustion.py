"""A PostgreSQL with no connection free for us: the start-up wait says why at once, and pools give back idle
connections (docs/limits.md)."""

from __future__ import annotations

import logging
import uuid
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from streams.config import Settings
from streams.errors import ServiceNotReadyError
from streams.ledger.connect_options import application_name
from streams.ledger.pool import create_pool
from streams.setup import readiness
from tests.support import wait_for

pytestmark = pytest.mark.integration

ROLE = "streams_test_edgesdocs_full"


def _as_role(url: str, role: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{host}"))


async def test_a_start_up_wait_says_at_once_that_the_server_has_no_connection_for_us(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """A role allowed no connection meets what a full server answers (SQLSTATE 53300, too many connections)."""
    url = settings.database_url.get_secret_value()
    password = uuid.uuid4().hex
    admin = await asyncpg.connect(url)
    try:
        await admin.execute(f"DROP ROLE IF EXISTS {ROLE}")
        await admin.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{password}' CONNECTION LIMIT 0")
        caplog.set_level(logging.WARNING, logger="streams.setup.readiness")
        limited = settings.replace(database_url=_as_role(url, ROLE, password))
        with pytest.raises(ServiceNotReadyError) as info:
            await readiness.check_postgres(limited, deadline_s=3.0)
        lines = [r.getMessage() for r in caplog.records]
        assert "too many connections" in str(info.value)
    finally:
        await admin.execute(f"DROP ROLE IF EXISTS {ROLE}")
        await admin.close()
    assert len(lines) == 1, lines  # at once, and not again within WAIT_LOG_INTERVAL_S (5 s) of the 3 s
    assert lines[0].startswith("postgres (127.0.0.1:5432/")
    assert "(1 attempt), waiting: TooManyConnectionsError: too many connections for role" in lines[0]


async def test_a_pool_closes_connections_idle_for_its_lifetime_down_to_its_floor(settings: Settings) -> None:
    url = settings.database_url.get_secret_value()
    tag = f"idle-{uuid.uuid4().hex[:8]}"
    named = url + ("&" if "?" in url else "?") + f"application_name={tag}"
    pool = await create_pool(named, min_size=1, max_size=4, idle_lifetime_s=0.5)
    name = application_name(named, worker=False)  # "streams/<tag>": the URL's name after the package's
    watcher = await asyncpg.connect(url)
    count = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
    try:
        async with pool.acquire() as a, pool.acquire() as b, pool.acquire() as c:
            for conn in (a, b, c):
                await conn.fetchval("SELECT 1")
            assert await watcher.fetchval(count, name) == 3

        async def given_back() -> bool:
            return bool(await watcher.fetchval(count, name) == 1)  # the pool's floor (min_size) stays

        await wait_for(given_back, 30, "the idle connections over the floor to be closed")
        assert await pool.fetchval("SELECT 2") == 2
    finally:
        await pool.close()
        await watcher.close()
