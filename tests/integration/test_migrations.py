"""The applied schema matches the code: state enum, legal transitions, and every migration file applied."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from streams.states import OperationState, can_transition

pytestmark = pytest.mark.integration

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


async def test_state_enum_mirrors_python(pool: asyncpg.Pool) -> None:
    labels = await pool.fetchval("SELECT enum_range(NULL::operation_state)::text[]")
    assert labels == [s.value for s in OperationState]


async def test_transition_table_mirrors_python(pool: asyncpg.Pool) -> None:
    rows = await pool.fetch("SELECT from_state::text, to_state::text FROM operation_state_transitions")
    in_db = {(r["from_state"], r["to_state"]) for r in rows}
    in_code = {(a.value, b.value) for a in OperationState for b in OperationState if can_transition(a, b)}
    assert in_db == in_code
    assert len(in_db) == 17


async def test_every_migration_file_is_applied(pool: asyncpg.Pool) -> None:
    applied = {r["migration_id"] for r in await pool.fetch("SELECT migration_id FROM _yoyo_migration")}
    files = {p.name.removesuffix(".sql") for p in MIGRATIONS.glob("*.sql") if not p.name.endswith(".rollback.sql")}
    assert files and files <= applied


async def test_trigger_refuses_illegal_transition_and_fencing_regression(pool: asyncpg.Pool) -> None:
    await pool.execute(
        "INSERT INTO operations (operation_id, request, state, remote_job_id, fencing_token, updated_by)"
        " VALUES ('op-t', '{}', 'succeeded', 'job-1', 5, 'test')"
    )
    with pytest.raises(asyncpg.CheckViolationError, match="illegal transition succeeded -> running"):
        await pool.execute("UPDATE operations SET state = 'running' WHERE operation_id = 'op-t'")
    with pytest.raises(asyncpg.CheckViolationError, match="fencing token"):
        await pool.execute("UPDATE operations SET fencing_token = 4 WHERE operation_id = 'op-t'")
    with pytest.raises(asyncpg.CheckViolationError, match="never changes"):
        await pool.execute("UPDATE operations SET remote_job_id = 'job-2' WHERE operation_id = 'op-t'")
    assert await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = 'op-t'") == "succeeded"


async def test_outbox_refuses_second_row_for_same_output(pool: asyncpg.Pool) -> None:
    await pool.execute("INSERT INTO operations (operation_id, request, updated_by) VALUES ('op-o', '{}', 'test')")
    insert = (
        "INSERT INTO outbox (event_id, topic_role, operation_id, output_id, payload)"
        " VALUES ($1, 'outputs_delivered', 'op-o', 'out_0', '{}')"
    )
    await pool.execute(insert, "output:op-o:out_0")
    with pytest.raises(asyncpg.UniqueViolationError):
        await pool.execute(insert, "output:op-o:out_0-again")


async def test_every_state_change_is_logged_with_its_outbox_event(pool: asyncpg.Pool) -> None:
    await pool.execute("INSERT INTO operations (operation_id, request, updated_by) VALUES ('op-l', '{}', 'w1')")
    await pool.execute(
        "UPDATE operations SET state = 'submitting', fencing_token = 1, updated_by = 'w2' WHERE operation_id = 'op-l'"
    )
    await pool.execute("UPDATE operations SET poll_count = 3 WHERE operation_id = 'op-l'")  # not a state change
    rows = await pool.fetch(
        "SELECT from_state::text, to_state::text, fencing_token, worker FROM transitions WHERE operation_id = 'op-l'"
        " ORDER BY id"
    )
    assert [tuple(r) for r in rows] == [(None, "accepted", 0, "w1"), ("accepted", "submitting", 1, "w2")]
    events = await pool.fetch("SELECT event_id, payload FROM outbox WHERE operation_id = 'op-l' ORDER BY id")
    assert [e["event_id"] for e in events] == ["transition:op-l:accepted", "transition:op-l:submitting"]
    assert events[1]["payload"]["from_state"] == "accepted" and events[1]["payload"]["fencing_token"] == 1
