"""The applied schema matches the code: state enum, legal transitions, and every migration file applied."""

from __future__ import annotations

import uuid
from pathlib import Path

import asyncpg
import pytest
from pydantic import SecretStr
from yoyo import get_backend

from streams.config import Settings
from streams.ledger.sql import LEDGER, RETENTION
from streams.model.codes import ReasonCode, RemoteCallOutcome
from streams.model.states import OperationState, can_transition
from streams.setup.admin import sql_migrations, yoyo_url
from streams_harness.services import create_run_database, drop_run_database
from tests.integration.operators_support import streams_cli

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
    assert len(in_db) == 25


async def test_remote_call_outcomes_mirror_python(pool: asyncpg.Pool) -> None:
    in_db = {r["outcome"] for r in await pool.fetch("SELECT outcome FROM remote_call_outcomes")}
    assert in_db == {o.value for o in RemoteCallOutcome}
    with pytest.raises(asyncpg.ForeignKeyViolationError, match="remote_calls_outcome_known"):
        await pool.execute(
            "INSERT INTO remote_calls (operation_id, method, outcome, duration_ms, worker)"
            " VALUES ('op-x', 'POST', 'notsent', 1.0, 'w')"
        )


async def test_reason_codes_mirror_python_and_go_with_the_reason(pool: asyncpg.Pool) -> None:
    in_db = {r["reason_code"] for r in await pool.fetch("SELECT reason_code FROM reason_codes")}
    assert in_db == {c.value for c in ReasonCode}
    await pool.execute("INSERT INTO operations (operation_id, request, updated_by) VALUES ('op-rc', '{}', 'w')")
    await pool.execute("UPDATE operations SET state = 'submitting' WHERE operation_id = 'op-rc'")
    with pytest.raises(asyncpg.CheckViolationError, match="reason_code_with_reason"):
        await pool.execute("UPDATE operations SET state = 'uncertain', reason = 'r' WHERE operation_id = 'op-rc'")
    with pytest.raises(asyncpg.ForeignKeyViolationError):
        await pool.execute(
            "UPDATE operations SET state = 'uncertain', reason = 'r', reason_code = 'r' WHERE operation_id = 'op-rc'"
        )


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
    assert [e["event_id"] for e in events] == ["transition:op-l:1:accepted", "transition:op-l:2:submitting"]
    assert events[1]["payload"]["from_state"] == "accepted" and events[1]["payload"]["fencing_token"] == 1
    assert [e["payload"]["seq"] for e in events] == [1, 2]


async def test_a_state_entered_twice_is_logged_twice_with_distinct_deterministic_event_ids(pool: asyncpg.Pool) -> None:
    await pool.execute(
        "INSERT INTO operations (operation_id, request, state, remote_job_id, updated_by)"
        " VALUES ('op-2x', '{}', 'submitted', 'job-2x', 'w')"
    )
    stall = (
        "UPDATE operations SET state = 'stalled', reason = 'r', reason_code = 'max_age', last_observation = '{}'"
        " WHERE operation_id = 'op-2x'"
    )
    await pool.execute(stall)
    await pool.execute("UPDATE operations SET state = 'submitted' WHERE operation_id = 'op-2x'")
    await pool.execute(stall)
    rows = await pool.fetch(
        "SELECT seq, from_state::text, to_state::text FROM transitions WHERE operation_id = 'op-2x' ORDER BY id"
    )
    assert [tuple(r) for r in rows] == [
        (1, None, "submitted"),
        (2, "submitted", "stalled"),
        (3, "stalled", "submitted"),
        (4, "submitted", "stalled"),
    ]
    events = await pool.fetch("SELECT event_id FROM outbox WHERE operation_id = 'op-2x' ORDER BY id")
    assert [e["event_id"] for e in events] == [
        "transition:op-2x:1:submitted",
        "transition:op-2x:2:stalled",
        "transition:op-2x:3:submitted",
        "transition:op-2x:4:stalled",
    ]
    # The sequence is the database's: a query cannot set it.
    await pool.execute("UPDATE operations SET transition_seq = 1 WHERE operation_id = 'op-2x'")
    assert await pool.fetchval("SELECT transition_seq FROM operations WHERE operation_id = 'op-2x'") == 4


async def test_stalled_keeps_its_reason_and_last_answer_and_is_never_polled(pool: asyncpg.Pool) -> None:
    await pool.execute(
        "INSERT INTO operations (operation_id, request, state, remote_job_id, updated_by)"
        " VALUES ('op-s', '{}', 'running', 'job-s', 'w')"
    )
    with pytest.raises(asyncpg.CheckViolationError, match="reason_when_uncertain_rejected_or_stalled"):
        await pool.execute(
            "UPDATE operations SET state = 'stalled', last_observation = '{}' WHERE operation_id = 'op-s'"
        )
    with pytest.raises(asyncpg.CheckViolationError, match="last_answer_kept_when_stalled"):
        await pool.execute(
            "UPDATE operations SET state = 'stalled', reason = 'r', reason_code = 'max_age' WHERE operation_id = 'op-s'"
        )
    with pytest.raises(asyncpg.CheckViolationError, match="polled_only_while_pollable"):
        await pool.execute(
            "UPDATE operations SET state = 'stalled', reason = 'r', reason_code = 'max_age', last_observation = '{}',"
            " next_poll_at = now()"
            " WHERE operation_id = 'op-s'"
        )
    with pytest.raises(asyncpg.CheckViolationError, match="illegal transition running -> submitted"):
        await pool.execute("UPDATE operations SET state = 'submitted' WHERE operation_id = 'op-s'")


#: The migrations of the stalled state and reconciliation.
OURS = ("0002.1.", "0002.2.")


async def test_migrations_roll_back_and_apply_again(migrated: Settings) -> None:
    """0002's rollbacks restore 0001's schema (enum without 'stalled', one row per state in the log), refuse to
    run while an operation is stalled, and the migrations apply again on top."""
    base_url = migrated.database_url.get_secret_value()
    run_url = await create_run_database(base_url, f"mig{uuid.uuid4().hex[:8]}")
    try:
        backend = get_backend(yoyo_url(run_url))
        migrations = sql_migrations(MIGRATIONS)
        with backend.lock():  # up to 0002: the later ones are rolled back by their own tests
            backend.apply_migrations(backend.to_apply(migrations.filter(lambda m: m.id.startswith(("0001.", *OURS)))))
        conn = await asyncpg.connect(run_url)
        try:
            await conn.execute(
                "INSERT INTO operations (operation_id, request, state, remote_job_id, updated_by)"
                " VALUES ('op-r', '{}', 'running', 'job-r', 'w');"
                "UPDATE operations SET state = 'stalled', reason = 'r', last_observation = '{}'"
                " WHERE operation_id = 'op-r'"
            )
            with backend.lock(), pytest.raises(Exception, match="operations are stalled"):
                backend.rollback_migrations(backend.to_rollback(migrations.filter(lambda m: m.id.startswith(OURS))))
            await conn.execute("UPDATE operations SET state = 'failed' WHERE operation_id = 'op-r'")
            with backend.lock(), pytest.raises(Exception, match="the transition log holds stalled steps"):
                backend.rollback_migrations(backend.to_rollback(migrations.filter(lambda m: m.id.startswith(OURS))))
            await conn.execute(
                "DELETE FROM outbox; DELETE FROM transitions; DELETE FROM remote_jobs; DELETE FROM operations;"
                "INSERT INTO operations (operation_id, request, updated_by) VALUES ('op-r', '{}', 'w');"
                "UPDATE operations SET state = 'submitting' WHERE operation_id = 'op-r';"
                "UPDATE operations SET state = 'uncertain', reason = 'r' WHERE operation_id = 'op-r';"
                "UPDATE operations SET state = 'rejected' WHERE operation_id = 'op-r';"
            )
            with backend.lock():
                backend.rollback_migrations(backend.to_rollback(migrations.filter(lambda m: m.id.startswith(OURS))))
            labels = await conn.fetchval("SELECT enum_range(NULL::operation_state)::text[]")
            assert labels == [s.value for s in OperationState if s is not OperationState.STALLED]
            assert await conn.fetchval("SELECT count(*) FROM operation_state_transitions") == 17
            assert await conn.fetchval("SELECT state::text FROM operations WHERE operation_id = 'op-r'") == "rejected"
            assert await conn.fetchval("SELECT to_regclass('remote_jobs')") is None
            with backend.lock():
                backend.apply_migrations(backend.to_apply(migrations))
            assert await conn.fetchval("SELECT enum_range(NULL::operation_state)::text[]") == [
                s.value for s in OperationState
            ]
            assert await conn.fetchval("SELECT transition_seq FROM operations WHERE operation_id = 'op-r'") == 4
            assert (
                await conn.fetchval("SELECT reason_code FROM operations WHERE operation_id = 'op-r'") == "unclassified"
            )
        finally:
            await conn.close()
    finally:
        await drop_run_database(base_url, run_url)


async def test_explicit_codes_rename_legacy_outcomes_and_roll_back(migrated: Settings) -> None:
    """0003 renames the outcomes written before it (class-name spellings, raw status words) to the codes and
    refuses unknown ones from then on; its rollback removes the reference table and keeps the rows."""
    base_url = migrated.database_url.get_secret_value()
    run_url = await create_run_database(base_url, f"mig{uuid.uuid4().hex[:8]}")
    try:
        backend = get_backend(yoyo_url(run_url))
        migrations = sql_migrations(MIGRATIONS)
        before = migrations.filter(lambda m: m.id < "0003.")  # the ones 0003 finds applied
        with backend.lock():
            backend.apply_migrations(backend.to_apply(before))
        conn = await asyncpg.connect(run_url)
        legacy = ["notsent", "unknownoutcome", "ratelimited", "refused", "Completed", "pending", "lookup_transient"]
        try:
            await conn.executemany(
                "INSERT INTO remote_calls (operation_id, method, outcome, duration_ms, worker)"
                " VALUES ('op-m', 'GET', $1, 1.0, 'w')",
                [(o,) for o in legacy],
            )
            with backend.lock():
                backend.apply_migrations(backend.to_apply(migrations))
            renamed = [r["outcome"] for r in await conn.fetch("SELECT outcome FROM remote_calls ORDER BY id")]
            assert renamed == [
                "not_sent",
                "unknown_outcome",
                "rate_limited",
                "refused",
                "succeeded",
                "queued",
                "lookup_transient",
            ]
            with backend.lock():
                backend.rollback_migrations(backend.to_rollback(migrations.filter(lambda m: m.id.startswith("0003."))))
            assert await conn.fetchval("SELECT to_regclass('remote_call_outcomes')") is None
            assert await conn.fetchval("SELECT count(*) FROM remote_calls") == len(legacy)
        finally:
            await conn.close()
    finally:
        await drop_run_database(base_url, run_url)


async def test_accepted_index_replaces_the_state_index_and_rolls_back(migrated: Settings) -> None:
    """0005 replaces the index on every operation's state with a partial index on accepted operations (the search
    for stale accepted ones uses it); its rollback restores the state index."""
    base_url = migrated.database_url.get_secret_value()
    run_url = await create_run_database(base_url, f"mig{uuid.uuid4().hex[:8]}")
    indexes = "SELECT array_agg(indexname::text ORDER BY indexname) FROM pg_indexes WHERE tablename = 'operations'"
    try:
        backend = get_backend(yoyo_url(run_url))
        migrations = sql_migrations(MIGRATIONS)
        with backend.lock():
            backend.apply_migrations(backend.to_apply(migrations))
        conn = await asyncpg.connect(run_url)
        try:
            applied = await conn.fetchval(indexes)
            assert "operations_accepted" in applied and "operations_state" not in applied
            await conn.execute("SET enable_seqscan = off")
            plan = await conn.fetchval("EXPLAIN (FORMAT JSON) " + LEDGER.stale_accepted.sql, 60.0, 10)
            assert "operations_accepted" in str(plan)
            with backend.lock():
                backend.rollback_migrations(backend.to_rollback(migrations.filter(lambda m: m.id.startswith("0005."))))
            rolled_back = await conn.fetchval(indexes)
            assert "operations_state" in rolled_back and "operations_accepted" not in rolled_back
        finally:
            await conn.close()
    finally:
        await drop_run_database(base_url, run_url)


async def test_purged_ids_indexes_are_built_anew_over_a_failed_builds_leftover_and_used(migrated: Settings) -> None:
    """0022 builds its indexes CONCURRENTLY, outside a transaction: a build that failed leaves an index of the same
    name (invalid) and the migration unrecorded, so the next run must build it anew rather than skip it."""
    base_url = migrated.database_url.get_secret_value()
    run_url = await create_run_database(base_url, f"mig{uuid.uuid4().hex[:8]}")
    indexes = (
        "SELECT array_agg(i.indexrelid::regclass::text ORDER BY 1) FROM pg_index i "
        "WHERE i.indrelid = ANY('{operations,outbox}'::regclass[]) AND i.indisvalid"
    )
    try:
        backend = get_backend(yoyo_url(run_url))
        migrations = sql_migrations(MIGRATIONS)
        ours = migrations.filter(lambda m: m.id.startswith("0022."))
        with backend.lock():
            backend.apply_migrations(backend.to_apply(migrations))
        conn = await asyncpg.connect(run_url)
        try:
            applied = await conn.fetchval(indexes)
            assert {"operations_purged", "outbox_operation_output"} <= set(applied)
            assert "outbox_one_row_per_output" not in applied
            with backend.lock():
                backend.rollback_migrations(backend.to_rollback(ours))
            assert "outbox_one_row_per_output" in await conn.fetchval(indexes)
            # what a failed run leaves: an invalid index of the name (a concurrent build that failed), the migration
            # not recorded
            for op in ("mig-a", "mig-b"):
                await conn.execute(
                    "INSERT INTO operations (operation_id, request, updated_by) VALUES ($1, '{}', 'test')", op
                )
            with pytest.raises(asyncpg.UniqueViolationError):
                await conn.execute("CREATE UNIQUE INDEX CONCURRENTLY operations_purged ON operations ((1))")
            invalid = "SELECT indisvalid FROM pg_index WHERE indexrelid = 'operations_purged'::regclass"
            assert await conn.fetchval(invalid) is False
            with backend.lock():
                backend.apply_migrations(backend.to_apply(migrations))
            assert await conn.fetchval(invalid) is True
            definition = await conn.fetchval("SELECT pg_get_indexdef('operations_purged'::regclass)")
            assert "GREATEST(purged_at, replayed_at)" in definition and "WHERE (purged_at IS NOT NULL)" in definition
            await conn.execute("SET enable_seqscan = off")
            plan = await conn.fetchval("EXPLAIN (FORMAT JSON) " + RETENTION.forget_ids_batch.sql, 86400.0, 10)
            assert "operations_purged" in str(plan)
        finally:
            await conn.close()
    finally:
        await drop_run_database(base_url, run_url)


async def test_streams_migrate_on_a_new_database_prints_its_lines_without_yoyos_steps(migrated: Settings) -> None:
    """`streams migrate` at the default INFO level on a new database: its three lines on stdout (the first one
    counting the migrations applied), and on stderr none of yoyo's INFO lines (one per migration and per step:
    about 150 for the migrations here)."""
    base_url = migrated.database_url.get_secret_value()
    run_url = await create_run_database(base_url, f"mig{uuid.uuid4().hex[:8]}")
    try:
        new = migrated.model_copy(update={"database_url": SecretStr(run_url)})
        result = await streams_cli(new, "migrate")
        assert result.exit_code == 0, result.stderr
        ids = [m.id for m in sql_migrations(MIGRATIONS)]
        assert result.stdout.splitlines()[0] == f"migrations applied: {len(ids)} ({ids[0]} .. {ids[-1]})"
        assert len(ids) > 1 and "yoyo" not in result.stderr and "applying step" not in result.stderr
    finally:
        await drop_run_database(base_url, run_url)
