"""The operators' decisions in the ledger (adopt, abandon, repoll, fail) against the real PostgreSQL: each is
fenced, logged with its outbox event, refuses every other state with a clear error, and keeps the accounting."""

from __future__ import annotations

import time

import asyncpg
import pytest

from streams.errors import OperatorActionRefusedError, UnknownOperationError
from streams.ledger.records import RemoteCall
from streams.ledger.store import Ledger
from streams.model.answers import JobSnapshot
from streams.model.codes import ReasonCode, RemoteCallOutcome
from streams.model.states import OperationState

pytestmark = pytest.mark.integration

S = OperationState
REQUEST = '{"input": {"prompt": "p", "max_tokens": 1}}'


async def uncertain(ledger: Ledger, op: str) -> int:
    """An operation whose POST outcome is unknown; returns the dispatcher's fencing value."""
    assert await ledger.accept(op, REQUEST, submitted_at_ms=0)
    fencing = await ledger.claim_for_submit(op)
    assert fencing is not None
    assert await ledger.save_submission_without_job(
        op, fencing, S.UNCERTAIN, "connection lost after send", ReasonCode.UNKNOWN_OUTCOME
    )
    return fencing


async def submitted(ledger: Ledger, op: str, job: str) -> int:
    assert await ledger.accept(op, REQUEST, submitted_at_ms=0)
    fencing = await ledger.claim_for_submit(op)
    assert fencing is not None
    assert await ledger.save_submitted(op, fencing, job, 0.0, None)
    return fencing


async def stalled(ledger: Ledger, pool: asyncpg.Pool, op: str, job: str) -> None:
    await submitted(ledger, op, job)
    await pool.execute(
        "UPDATE operations SET state = 'stalled', reason = 'status aborted 5 times', reason_code = 'unknown_status',"
        " next_poll_at = NULL,"
        ' last_observation = \'{"http_status": 200, "body": "{}"}\', unknown_status_count = 5'
        " WHERE operation_id = $1",
        op,
    )


async def row(pool: asyncpg.Pool, op: str) -> asyncpg.Record:
    record = await pool.fetchrow("SELECT *, state::text AS state_text FROM operations WHERE operation_id = $1", op)
    assert record is not None
    return record


async def last_transition(pool: asyncpg.Pool, op: str) -> asyncpg.Record:
    record = await pool.fetchrow(
        "SELECT seq, from_state::text, to_state::text, reason, worker, fencing_token FROM transitions"
        " WHERE operation_id = $1 ORDER BY id DESC LIMIT 1",
        op,
    )
    assert record is not None
    return record


async def test_adopt_moves_uncertain_to_submitted_fenced_logged_published_and_accounted(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    old_fencing = await uncertain(ledger, "op-a")
    move = await ledger.adopt("op-a", "job_found", "found at the provider's console", "alice")
    assert (move.from_state, move.to_state, move.transition_seq) == (S.UNCERTAIN, S.SUBMITTED, 4)
    assert move.fencing_token == old_fencing + 1
    r = await row(pool, "op-a")
    assert (r["state_text"], r["remote_job_id"], r["fencing_token"]) == ("submitted", "job_found", old_fencing + 1)
    assert r["next_poll_at"] is not None and r["remote_job_id_saved_at"] is not None
    t = await last_transition(pool, "op-a")
    assert (t["seq"], t["from_state"], t["to_state"], t["worker"]) == (4, "uncertain", "submitted", "alice")
    assert t["reason"] == "adopted job job_found (alice): found at the provider's console"
    event = await pool.fetchrow("SELECT event_id, payload FROM outbox WHERE operation_id = 'op-a' ORDER BY id DESC")
    assert event["event_id"] == "transition:op-a:4:submitted"
    assert event["payload"]["remote_job_id"] == "job_found" and event["payload"]["from_state"] == "uncertain"
    account = await pool.fetchrow("SELECT learned_via, learned_by, operation_id FROM remote_jobs")
    assert tuple(account) == ("adopted", "alice", "op-a")
    # The dispatcher that held the old fencing value can no longer save anything.
    assert not await ledger.save_submitted("op-a", old_fencing, "job_other", 0.0, None)
    # The adopted job is observed like any other: the scheduler claims its poll.
    polls = await ledger.claim_due_polls(10, 5.0)
    assert [(p.operation_id, p.remote_job_id) for p in polls] == [("op-a", "job_found")]


@pytest.mark.parametrize("state", ["accepted", "submitting", "submitted", "stalled", "rejected", "succeeded"])
async def test_adopt_and_abandon_refuse_every_state_but_uncertain(
    ledger: Ledger, pool: asyncpg.Pool, state: str
) -> None:
    op = f"op-{state}"
    if state == "stalled":
        await stalled(ledger, pool, op, "job-s")
    else:
        assert await ledger.accept(op, REQUEST, submitted_at_ms=0)
        path = {
            "accepted": [],
            "submitting": ["submitting"],
            "submitted": ["submitting", "submitted"],
            "rejected": ["submitting", "rejected"],
            "succeeded": ["submitting", "submitted", "succeeded"],
        }[state]
        for step in path:
            await pool.execute(
                "UPDATE operations SET state = $2::operation_state, reason = 'r', reason_code = 'unclassified',"
                " remote_job_id = CASE WHEN $2 IN ('submitted', 'succeeded') THEN 'job-x' END"
                " WHERE operation_id = $1",
                op,
                step,
            )
    before = await row(pool, op)
    with pytest.raises(OperatorActionRefusedError, match=f"it is {state}; adopt applies only to uncertain") as info:
        await ledger.adopt(op, "job-new", "found", "alice")
    assert (info.value.state, info.value.action, info.value.operation_id) == (state, "adopt", op)
    with pytest.raises(OperatorActionRefusedError, match=f"it is {state}; abandon applies only to uncertain"):
        await ledger.abandon(op, "checked", "alice")
    after = await row(pool, op)
    assert (after["state_text"], after["fencing_token"], after["transition_seq"]) == (
        before["state_text"],
        before["fencing_token"],
        before["transition_seq"],
    )
    assert await pool.fetchval("SELECT count(*) FROM remote_jobs WHERE learned_via = 'adopted'") == 0


async def test_adopt_refuses_bad_input_unknown_operations_and_a_job_of_another_operation(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    await uncertain(ledger, "op-u")
    await submitted(ledger, "op-other", "job-taken")
    for bad in ("", "a/b", "x" * 300):
        with pytest.raises(OperatorActionRefusedError, match="not a usable remote job id"):
            await ledger.adopt("op-u", bad, "found", "alice")
    with pytest.raises(OperatorActionRefusedError, match="give a reason"):
        await ledger.adopt("op-u", "job-1", "  ", "alice")
    with pytest.raises(OperatorActionRefusedError, match="name who decides"):
        await ledger.abandon("op-u", "checked", "")
    with pytest.raises(OperatorActionRefusedError, match="already saved for operation 'op-other'"):
        await ledger.adopt("op-u", "job-taken", "found", "alice")
    with pytest.raises(UnknownOperationError, match="'op-none' is not in the ledger"):
        await ledger.adopt("op-none", "job-1", "found", "alice")
    assert (await row(pool, "op-u"))["state_text"] == "uncertain"


async def test_abandon_records_not_created_checked_by_an_operator(ledger: Ledger, pool: asyncpg.Pool) -> None:
    fencing = await uncertain(ledger, "op-ab")
    move = await ledger.abandon("op-ab", "no job with this reference in the provider's console", "bob")
    assert (move.to_state, move.fencing_token) == (S.REJECTED, fencing + 1)
    t = await last_transition(pool, "op-ab")
    assert (t["from_state"], t["to_state"], t["worker"]) == ("uncertain", "rejected", "bob")
    assert (
        t["reason"] == "not created, checked by an operator (bob): no job with this reference in the provider's console"
    )
    assert await pool.fetchval("SELECT count(*) FROM remote_jobs") == 0
    with pytest.raises(OperatorActionRefusedError, match="it is rejected"):
        await ledger.abandon("op-ab", "again", "bob")


async def test_repoll_observes_a_stalled_job_again_and_refuses_other_states(ledger: Ledger, pool: asyncpg.Pool) -> None:
    await stalled(ledger, pool, "op-r", "job-r")
    stale = (await row(pool, "op-r"))["fencing_token"]
    move = await ledger.repoll("op-r", "carol")
    assert (move.from_state, move.to_state, move.transition_seq) == (S.STALLED, S.SUBMITTED, 5)
    r = await row(pool, "op-r")
    assert (r["state_text"], r["unknown_status_count"], r["fencing_token"]) == ("submitted", 0, stale + 1)
    assert r["next_poll_at"] is not None and r["observing_since"] >= r["remote_job_id_saved_at"]
    t = await last_transition(pool, "op-r")
    assert (t["from_state"], t["to_state"], t["worker"]) == ("stalled", "submitted", "carol")
    assert t["reason"] == "repolled by an operator (carol): observe again"
    events = [
        r["event_id"] for r in await pool.fetch("SELECT event_id FROM outbox WHERE operation_id='op-r' ORDER BY id")
    ]
    assert events[-2:] == ["transition:op-r:4:stalled", "transition:op-r:5:submitted"]
    # A worker still holding the fencing value from before the repoll saves nothing.
    snapshot = JobSnapshot(job_id="job-r", status="running", state=S.RUNNING)
    assert (await ledger.save_observation("op-r", stale, snapshot, 1.0)).value == "refused_fencing"
    with pytest.raises(OperatorActionRefusedError, match="it is submitted; repoll applies only to stalled"):
        await ledger.repoll("op-r", "carol")
    with pytest.raises(OperatorActionRefusedError, match="it is submitted; fail applies only to stalled"):
        await ledger.fail("op-r", "gave up", "carol")


async def test_fail_ends_a_stalled_operation(ledger: Ledger, pool: asyncpg.Pool) -> None:
    await stalled(ledger, pool, "op-f", "job-f")
    move = await ledger.fail("op-f", "provider support: job lost", "dave")
    assert (move.from_state, move.to_state) == (S.STALLED, S.FAILED)
    t = await last_transition(pool, "op-f")
    assert (t["from_state"], t["to_state"], t["worker"]) == ("stalled", "failed", "dave")
    assert t["reason"] == "failed by an operator (dave): provider support: job lost"
    assert await pool.fetchval("SELECT outcome FROM remote_jobs WHERE remote_job_id = 'job-f'") is None
    with pytest.raises(OperatorActionRefusedError, match="it is failed"):
        await ledger.fail("op-f", "again", "dave")
    with pytest.raises(UnknownOperationError):
        await ledger.repoll("op-missing", "dave")


async def test_accounting_summary_counts_jobs_decisions_and_calls(ledger: Ledger, pool: asyncpg.Pool) -> None:
    await submitted(ledger, "op-1", "job-1")
    await uncertain(ledger, "op-2")
    await stalled(ledger, pool, "op-3", "job-3")
    # stalled 90 s ago, by the database's clock (the summary rounds ages to 0.1 s)
    await pool.execute("UPDATE operations SET state_entered_at = now() - interval '90 s' WHERE operation_id = 'op-3'")
    after_update = time.monotonic()
    await ledger.record_remote_call(RemoteCall("op-1", "POST", 201, RemoteCallOutcome.CREATED, "job-1", 5.0, 1))
    await ledger.record_remote_call(RemoteCall("op-2", "POST", 503, RemoteCallOutcome.UNKNOWN_OUTCOME, None, 5.0, 1))
    await ledger.record_remote_call(RemoteCall("op-2", "POST", 429, RemoteCallOutcome.RATE_LIMITED, None, 5.0, 1))
    summary = await ledger.accounting_summary()
    since_update_s = time.monotonic() - after_update
    assert summary["needs_decision"]["uncertain"]["operations"] == 1
    assert summary["needs_decision"]["stalled"]["operations"] == 1
    assert 90.0 <= summary["needs_decision"]["stalled"]["oldest_age_s"] <= 90.0 + since_update_s + 0.05
    assert summary["posts_per_operation"] == {"operations": 2, "mean": 1.5, "max": 2}
    assert summary["duplicate_creations"] == 0
    assert summary["charges"] == [] and summary["refunds_settled"] == [] and summary["refunds_pending"] == 0
    assert (await ledger.accounting_summary("op-1%"))["needs_decision"]["uncertain"]["operations"] == 0
