"""The group roles of migration 0008, for real: a login role granted ``streams_worker`` runs the pipeline's writes
but cannot rewrite the transition log or the accounting rows; ``streams_readonly`` only reads."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from streams.config import Settings

pytestmark = pytest.mark.integration


def _as(settings: Settings, role: str, password: str) -> str:
    parts = urlsplit(settings.database_url.get_secret_value())
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{parts.hostname}:{parts.port or 5432}"))


@pytest.fixture
async def login_as(migrated: Settings, pool: asyncpg.Pool) -> AsyncIterator[Callable[[str], asyncpg.Connection]]:
    """``await login_as(group)``: a connection of a fresh login role granted ``group`` (dropped afterwards)."""
    made: list[tuple[str, asyncpg.Connection]] = []

    async def login(group: str) -> asyncpg.Connection:
        role, password = f"t_{group}_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
        await pool.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}' IN ROLE {group}")
        conn = await asyncpg.connect(_as(migrated, role, password))
        made.append((role, conn))
        return conn

    yield login
    for role, conn in made:
        await conn.close()
        await pool.execute(f"DROP ROLE {role}")


async def test_the_worker_writes_the_pipeline_but_cannot_rewrite_the_log(pool: asyncpg.Pool, login_as) -> None:  # type: ignore[no-untyped-def]
    worker = await login_as("streams_worker")
    await worker.execute(
        "INSERT INTO operations (operation_id, request, updated_by) VALUES ('roles-1', '{}', 'w1')"
    )  # its trigger appends the transition and the outbox row as the worker
    await worker.execute("UPDATE operations SET state = 'submitting', updated_by = 'w1' WHERE operation_id = 'roles-1'")
    await worker.execute(
        "INSERT INTO remote_calls (operation_id, method, outcome, duration_ms, worker) "
        "VALUES ('roles-1', 'POST', 'not_sent', 1.0, 'w1')"
    )
    assert await pool.fetchval("SELECT count(*) FROM transitions WHERE operation_id = 'roles-1'") == 2

    refused = [
        "UPDATE transitions SET reason = 'rewritten' WHERE operation_id = 'roles-1'",
        "DELETE FROM transitions WHERE operation_id = 'roles-1'",
        "UPDATE remote_calls SET outcome = 'refused' WHERE operation_id = 'roles-1'",
        "DELETE FROM remote_calls WHERE operation_id = 'roles-1'",
        "DELETE FROM refunds",
        "DELETE FROM remote_jobs",
        "DELETE FROM operations WHERE operation_id = 'roles-1'",
        "TRUNCATE transitions",
    ]
    for statement in refused:
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="permission denied"):
            await worker.execute(statement)
    assert await pool.fetchval("SELECT count(*) FROM transitions WHERE operation_id = 'roles-1'") == 2
    assert await pool.fetchval("SELECT outcome FROM remote_calls WHERE operation_id = 'roles-1'") == "not_sent"


async def test_the_operator_decides_but_cannot_rewrite_the_log(pool: asyncpg.Pool, login_as) -> None:  # type: ignore[no-untyped-def]
    await pool.execute(
        "INSERT INTO operations (operation_id, request, updated_by) VALUES ('roles-2', '{}', 'w1');"
        "UPDATE operations SET state = 'submitting', updated_by = 'w1' WHERE operation_id = 'roles-2';"
        "UPDATE operations SET state = 'uncertain', reason = 'r', reason_code = 'unknown_outcome', updated_by = 'w1' "
        "WHERE operation_id = 'roles-2'"
    )
    operator = await login_as("streams_operator")
    await operator.execute(
        "UPDATE operations SET state = 'rejected', reason = 'checked', reason_code = 'abandoned_by_operator', "
        "fencing_token = fencing_token + 1, updated_by = 'alice' WHERE operation_id = 'roles-2'"
    )
    assert (
        await pool.fetchval("SELECT worker FROM transitions WHERE operation_id = 'roles-2' AND to_state = 'rejected'")
        == "alice"
    )
    for statement in ("UPDATE transitions SET worker = 'bob'", "DELETE FROM remote_calls"):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await operator.execute(statement)
    # 0009: the log goes only with a terminal operation (streams purge); a live operation's log is kept
    await pool.execute("INSERT INTO operations (operation_id, request, updated_by) VALUES ('roles-2b', '{}', 'w1')")
    with pytest.raises(asyncpg.CheckViolationError, match="not terminal"):
        await operator.execute("DELETE FROM transitions WHERE operation_id = 'roles-2b'")


async def test_read_only_reads_and_writes_nothing(pool: asyncpg.Pool, login_as) -> None:  # type: ignore[no-untyped-def]
    reader = await login_as("streams_readonly")
    assert await reader.fetchval("SELECT count(*) FROM transitions") == 0
    for statement in (
        "INSERT INTO operations (operation_id, request, updated_by) VALUES ('roles-3', '{}', 'x')",
        "UPDATE operations SET updated_by = 'x'",
        "DELETE FROM outbox",
    ):
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await reader.execute(statement)
