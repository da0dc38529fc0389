"""Every operator's command as a person on call runs it: the ``streams`` script in a subprocess with
``STREAMS_DATABASE_URL`` naming a login role granted only ``streams_operator`` (migration 0008, docs/operating-data.md
"Roles"), on the real ledger, Redis and Kafka. Each succeeds; the commands that need the owner's rights
(``migrate``, ``teardown`` of a database) fail with one line saying so, never a traceback."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from streams.config import Settings
from streams.ledger.store import Ledger
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.dispatcher import Dispatcher
from tests.integration.operators_support import Result, Seeded, backdate, seed_ledger, streams_cli

pytestmark = pytest.mark.integration


def _as(settings: Settings, role: str, password: str) -> str:
    parts = urlsplit(settings.database_url.get_secret_value())
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{parts.hostname}:{parts.port or 5432}"))


@pytest.fixture
async def operator(settings: Settings, pool: asyncpg.Pool) -> AsyncIterator[tuple[Settings, str]]:
    """``settings`` logged in as a fresh login role granted only ``streams_operator``, and the role's name."""
    role, password = f"t_opcli_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await pool.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}' IN ROLE streams_operator")
    yield settings.replace(database_url=_as(settings, role, password)), role
    await pool.execute(f"DROP OWNED BY {role}")
    await pool.execute(f"DROP ROLE {role}")


@pytest.fixture
async def seeded(pool: asyncpg.Pool) -> tuple[Seeded, Seeded]:
    ledger = Ledger(pool, "seed-worker")
    return await seed_ledger(ledger, "opa"), await seed_ledger(ledger, "opb")


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result


async def test_every_operator_command_runs_as_the_operator_role(
    operator: tuple[Settings, str],
    seeded: tuple[Seeded, Seeded],
    pool: asyncpg.Pool,
    runtime: Runtime,
    tmp_path: Path,
) -> None:
    op_settings, role = operator
    a, b = seeded
    who = f"{role}@postgres-role"

    ok(await streams_cli(op_settings, "ready", "--timeout-s", "30"))
    listed = ok(await streams_cli(op_settings, "operations", "list", "--json")).json()
    assert listed["matched"] == 22
    shown = ok(await streams_cli(op_settings, "operations", "show", a.by_state["succeeded"][0], "--json")).json()
    assert shown["operation"]["operation_id"] == a.by_state["succeeded"][0] and len(shown["outputs"]) == 2

    # the relay published the outbox rows of everything (forget and purge wait for it)
    await pool.execute("UPDATE outbox SET published_at = now()")
    decisions = [
        ("adopt", a.by_state["uncertain"][0], "job-adopted-1", "--without-provider-check", "--reason", "console"),
        ("abandon", a.by_state["uncertain"][1], "--reason", "no job in the console"),
        ("repoll", a.by_state["stalled"][0], "--reason", "display bug"),
        ("fail", b.by_state["stalled"][0], "--reason", "aborted at the provider"),
        ("cancel", a.by_state["accepted"][0], "--reason", "not needed"),
        ("cancel", a.by_state["submitted"][0], "--reason", "not needed"),
        ("forget", a.by_state["succeeded"][1], "--reason", "erasure request 7"),
    ]
    for command, op, *rest in decisions:
        out = ok(await streams_cli(op_settings, "operations", command, op, *rest, "--json")).json()
        assert out["actor"].startswith(who), out
    states = dict(await pool.fetch("SELECT operation_id, state::text FROM operations"))
    assert [states[op] for _command, op, *_rest in decisions[:5]] == [
        "submitted",
        "rejected",
        "submitted",
        "failed",
        "canceled",
    ]
    assert await pool.fetchval("SELECT count(*) FROM cancellations") == 2
    assert await pool.fetchval("SELECT count(*) FROM erasures WHERE actor LIKE $1", who + "%") == 1

    report = ok(await streams_cli(op_settings, "accounting", "report", "--operation-prefix", "opa-", "--json")).json()
    assert report["jobs_by_outcome"]["succeeded"] == 3

    purged = b.by_state["failed"][0]
    await backdate(pool, purged, "2 days")
    preview = ok(await streams_cli(op_settings, "purge", "--older-than", "1d", "--dry-run", "--json")).json()
    assert preview["operations"] == 1
    done = ok(await streams_cli(op_settings, "purge", "--older-than", "1d", "--json")).json()
    assert done["operations"] == 1
    assert await pool.fetchval("SELECT request::text FROM operations WHERE operation_id = $1", purged) == "null"
    assert await pool.fetchval("SELECT count(*) FROM transitions WHERE operation_id = $1", purged) == 0

    dead = f"opdl-{uuid.uuid4().hex[:6]}"
    now_ms = int(time.time() * 1000)
    value = f'{{"operation_id": "{dead}", "request": {{"input": {{"max_tokens": 1}}}}, "submitted_at_ms": {now_ms}}}'
    await Dispatcher(runtime).handle(
        RawMessage(op_settings.topic("submissions"), 0, 3, dead.encode(), value[:-1].encode())
    )
    letters = ok(await streams_cli(op_settings, "dead-letters", "list", "--operation-id", dead, "--json")).json()
    (letter,) = letters["dead_letters"]
    ok(await streams_cli(op_settings, "dead-letters", "show", letter["record"]))
    fixed = tmp_path / "fixed.json"
    fixed.write_text(value)
    redriven = ok(
        await streams_cli(
            op_settings,
            "dead-letters",
            "redrive",
            letter["record"],
            "--value-file",
            str(fixed),
            "--why",
            "closed the object",
            "--json",
        )
    ).json()
    assert redriven["redrives"][0]["refused"] is None
    assert await pool.fetchval("SELECT actor FROM dead_letter_redrives") == redriven["actor"]

    assert ok(await streams_cli(op_settings, "config", "reference")).stdout.startswith("#")
    gone = f"streams_absent_{uuid.uuid4().hex[:6]}"
    ok(await streams_cli(op_settings, "teardown", "--database", gone, "--dry-run"))


async def test_the_owners_commands_fail_as_the_operator_role_with_one_line(
    operator: tuple[Settings, str], pool: asyncpg.Pool
) -> None:
    op_settings, role = operator
    migrate = await streams_cli(op_settings, "migrate")
    assert migrate.exit_code == 6, (migrate.stdout, migrate.stderr)
    assert "Traceback" not in migrate.stderr
    (line,) = migrate.stderr.strip().splitlines()[-1:]
    assert f"role {role} may not" in line and "database's owner" in line

    name = f"streams_t_op_{uuid.uuid4().hex[:6]}"
    await pool.execute(f"CREATE DATABASE {name}")
    try:
        refused = await streams_cli(op_settings, "teardown", "--database", name)
        assert refused.exit_code == 6, (refused.stdout, refused.stderr)
        assert "Traceback" not in refused.stderr
        assert f"role {role} may not" in refused.stderr and name in refused.stderr
        assert await pool.fetchval("SELECT count(*) FROM pg_database WHERE datname = $1", name) == 1
    finally:
        await pool.execute(f"DROP DATABASE IF EXISTS {name}")
