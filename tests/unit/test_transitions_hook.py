"""Which ledger statements tell the worker they wrote transitions, read from their SQL; and the connection names
the outbox trigger tells a worker's statements by (streams.ledger.written, migrations/0019.worker-transitions.sql).

A statement can write a transition when its SQL inserts an operation or sets an operation's ``state`` (the trigger
``operations_log_transition`` writes the outbox row). Every statement of the worker's ledger that runs such SQL is
marked :func:`streams.ledger.written.writes_transitions`, and no other: an unmarked one would leave its
transitions to another relay's long fallback (the trigger no longer notifies them).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from streams.ledger import connect_options, sql
from streams.ledger.protocol import PipelineLedger
from streams.ledger.store import BATCHED, Ledger
from streams.ledger.written import TRANSITIONS_MARK, AnnouncesTransitions, writes_transitions
from tests.fakes import InMemoryLedger

ROOT = Path(__file__).resolve().parents[2]

INSERTS_OPERATION = re.compile(r"INSERT\s+INTO\s+operations\b", re.IGNORECASE)
#: ``UPDATE operations ... SET ... state =`` before the statement's WHERE.
SETS_STATE = re.compile(
    r"UPDATE\s+operations\b(?:(?!;).)*?\bSET\b(?:(?!\bWHERE\b).)*?\bstate\s*=", re.IGNORECASE | re.DOTALL
)
QUERY_FILES = {
    "Q": sql.LEDGER,
    "RECONCILE": sql.RECONCILE,
    "CANCELLATIONS": sql.CANCELLATIONS,
    "CALLBACKS": sql.CALLBACKS,
}


def writes_a_transition(query: sql.Query) -> bool:
    return bool(INSERTS_OPERATION.search(query.sql) or SETS_STATE.search(query.sql))


def queries_of(method: Any) -> list[sql.Query]:
    """The queries a Ledger method runs: ``<FILE>.<query>`` in its source, and the batched statements it submits."""
    source = inspect.getsource(inspect.unwrap(method))
    found = [
        getattr(QUERY_FILES[f], q) for f, q in re.findall(r"\b(Q|RECONCILE|CANCELLATIONS|CALLBACKS)\.(\w+)", source)
    ]
    batched = {statement.name: statement.query for statement in BATCHED}
    found += [batched[name] for name in re.findall(r"_batches\.submit\(\s*\"(\w+)\"", source)]
    return found


def pipeline_statements() -> list[str]:
    members = [name for name in vars(PipelineLedger) if not name.startswith("_")]
    return sorted(name for name in members if inspect.iscoroutinefunction(getattr(Ledger, name, None)))


def test_the_sql_reading_finds_what_the_schema_says() -> None:
    """The reading itself, on statements whose effect is known: a state change, a claim, a read."""
    assert writes_a_transition(sql.LEDGER.accept_operation)
    assert writes_a_transition(sql.LEDGER.save_observation)
    assert writes_a_transition(sql.RECONCILE.adopt_found_job)
    assert not writes_a_transition(sql.LEDGER.claim_due_polls)  # sets poll_claim_id, never state
    assert not writes_a_transition(sql.RECONCILE.give_up_lookup)  # reads state in its WHERE only
    assert not writes_a_transition(sql.LEDGER.get_operation)


@pytest.mark.parametrize("name", pipeline_statements())
def test_a_statement_is_marked_exactly_when_its_sql_can_write_a_transition(name: str) -> None:
    method = getattr(Ledger, name)
    queries = queries_of(method)
    if name not in ("close", "announce_transitions", "relay_outbox", "claim_due_polls"):
        assert queries, f"Ledger.{name}: no query found in its source"
    writes = any(writes_a_transition(q) for q in queries)
    assert getattr(method, TRANSITIONS_MARK, False) is writes, (name, [q.name for q in queries])
    # the in-memory ledger of the unit tests announces the same statements
    assert getattr(getattr(InMemoryLedger, name), TRANSITIONS_MARK, False) is writes, name


def test_the_marked_statements_are_the_state_changes() -> None:
    marked = {name for name in pipeline_statements() if getattr(getattr(Ledger, name), TRANSITIONS_MARK, False)}
    assert marked == {
        "accept",
        "adopt_found_job",
        "claim_for_submit",
        "note_not_found",
        "note_poll_setback",
        "reconcile_stale_submitting",
        "request_cancel",
        "save_observation",
        "save_stalled",
        "save_submission_without_job",
        "save_submitted",
    }


async def test_the_hook_follows_a_statement_that_returned_or_raised() -> None:
    class Statements(AnnouncesTransitions):
        @writes_transitions
        async def ok(self) -> int:
            return 1

        @writes_transitions
        async def lost_reply(self) -> int:
            raise ConnectionResetError("the reply was lost; the statement may have committed")

    heard: list[str] = []
    statements = Statements()
    assert await statements.ok() == 1  # nobody listens: nothing to call
    statements.on_transitions_written = lambda: heard.append("written")
    assert await statements.ok() == 1
    with pytest.raises(ConnectionResetError):
        await statements.lost_reply()
    assert heard == ["written", "written"]


def test_the_trigger_skips_exactly_the_worker_connections_name() -> None:
    migration = (ROOT / "migrations" / "0019.worker-transitions.sql").read_text()
    (pattern,) = re.findall(r"NOT LIKE '([^']+)'", migration)
    assert pattern == connect_options.WORKER_APPLICATION_NAME + "%"
    assert not connect_options.APPLICATION_NAME.startswith(connect_options.WORKER_APPLICATION_NAME)


@pytest.mark.parametrize(
    ("url", "worker", "name"),
    [
        ("postgresql://u:p@h:5432/db", True, "streams-worker"),
        ("postgresql://u:p@h:5432/db", False, "streams"),
        ("postgresql://u:p@h:5432/db?sslmode=require&application_name=billing", True, "streams-worker/billing"),
        ("postgresql://u:p@h:5432/db?application_name=billing", False, "streams/billing"),
    ],
)
def test_application_name_keeps_the_urls_own_after_the_prefix(url: str, worker: bool, name: str) -> None:
    assert connect_options.application_name(url, worker=worker) == name


def test_a_long_application_name_is_cut_as_postgresql_would_and_keeps_the_prefix() -> None:
    name = connect_options.application_name("postgresql://h/db?application_name=" + "é" * 40, worker=True)
    assert len(name.encode()) <= connect_options.APPLICATION_NAME_MAX_BYTES
    assert name.startswith("streams-worker/é") and name.encode().decode() == name  # no half character
