"""Cancellation against PostgreSQL, Redis and the provider simulator (docs/cancellation.md): each state an
operation is canceled in, and the races with the claim, the POST's answer and the job's completion."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import orjson
import pytest

from streams import metrics
from streams.config import Settings
from streams.ledger.records import CancelPath
from streams.ledger.store import Ledger
from streams.model.answers import JobSnapshot
from streams.model.codes import ReasonCode, RemoteCallOutcome
from streams.model.states import OperationState
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.canceller import Canceller
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from streams.worker.wakeup import CANCEL
from tests.integration.test_callbacks import polling
from tests.integration.test_observer import claim_poll, state_of, submitted_operation
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration

REQUEST = '{"input": {"prompt": "ten words of a prompt for a job to run on", "max_tokens": 5}}'
#: The delay between two polls of a job where it is long (s): a cancel left for the job's next poll waits this long.
LONG_POLL_S = 30.0


def submission(op: str) -> RawMessage:
    value = f'{{"operation_id": "{op}", "request": {REQUEST}, "submitted_at_ms": {int(time.time() * 1000)}}}'
    return RawMessage("generation.submissions", 0, 0, op.encode(), value.encode())


def cancellation(op: str) -> RawMessage:
    value = {"operation_id": op, "reason": "no longer needed", "requested_by": "app", "requested_at_ms": 1}
    return RawMessage("generation.cancellations", 0, 0, op.encode(), orjson.dumps(value))


async def observe_until(runtime: Runtime, pool: asyncpg.Pool, op: str, states: set[str]) -> str:
    observer = Observer(runtime)

    async def ended() -> bool:
        if await state_of(pool, op) not in states:
            await pool.execute(
                "UPDATE operations SET next_poll_at = now() WHERE operation_id=$1 AND state IN "
                "('submitted','queued','running')",
                op,
            )
            await observer.handle(await claim_poll(runtime, op))
        return await state_of(pool, op) in states

    await wait_for(ended, 10, f"{op} to reach {states}")
    return await state_of(pool, op)


async def cancel_calls(pool: asyncpg.Pool, op: str) -> list[str]:
    rows = await pool.fetch(
        "SELECT outcome FROM remote_calls WHERE operation_id=$1 AND method='CANCEL' ORDER BY id", op
    )
    return [r["outcome"] for r in rows]


async def delivered_outputs(pool: asyncpg.Pool, op: str) -> int:
    return int(
        await pool.fetchval("SELECT count(*) FROM outbox WHERE operation_id=$1 AND topic_role='outputs_delivered'", op)
    )


async def test_accepted_ends_canceled_and_no_post_is_ever_sent(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    assert await runtime.ledger.accept("op-ca", REQUEST, submitted_at_ms=0)
    await Canceller(runtime).handle(cancellation("op-ca"))
    assert await state_of(pool, "op-ca") == "canceled"
    await Dispatcher(runtime).handle(submission("op-ca"))  # the submission's event handled after it
    assert (await simulator.get("/_sim/operations/op-ca"))["posts"] == 0
    row = await pool.fetchrow("SELECT reason_code, fencing_token FROM operations WHERE operation_id='op-ca'")
    assert row["reason_code"] == ReasonCode.CANCELED_BEFORE_SUBMIT
    record = await pool.fetchrow(
        "SELECT path, actor, reason, state_when_asked::text FROM cancellations WHERE operation_id='op-ca'"
    )
    assert tuple(record) == ("topic", "app", "no longer needed", "accepted")
    seq = await pool.fetch("SELECT to_state::text FROM transitions WHERE operation_id='op-ca' ORDER BY seq")
    assert [r["to_state"] for r in seq] == ["accepted", "canceled"]
    event = await pool.fetchval(
        "SELECT payload->>'to_state' FROM outbox WHERE operation_id='op-ca' ORDER BY id DESC LIMIT 1"
    )
    assert event == "canceled"  # published as every transition


async def test_a_cancel_before_the_submission_is_applied_by_the_claim(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    ask = await runtime.ledger.request_cancel("op-cb", CancelPath.OPERATOR, "alice", "duplicate order")
    assert (ask.state_when_asked, ask.recorded, ask.canceled_now) == (None, True, False)
    await Dispatcher(runtime).handle(submission("op-cb"))
    assert await state_of(pool, "op-cb") == "canceled"
    assert (await simulator.get("/_sim/operations/op-cb"))["posts"] == 0


async def test_the_claim_and_the_cancel_never_both_win(runtime: Runtime, pool: asyncpg.Pool) -> None:
    """Raced on 40 operations at once: either the claim wins (submitting: the POST goes out, the cancel is for the
    provider) or the cancel does (canceled, no fencing value for a POST); never a POST after a canceled state."""
    ops = [f"op-race-{i}" for i in range(40)]
    for op in ops:
        assert await runtime.ledger.accept(op, REQUEST, submitted_at_ms=0)

    async def race(op: str) -> tuple[int | None, bool]:
        claim, ask = await asyncio.gather(
            runtime.ledger.claim_for_submit(op),
            runtime.ledger.request_cancel(op, CancelPath.TOPIC, "app", "race"),
        )
        return claim, ask.canceled_now

    results = await asyncio.gather(*(race(op) for op in ops))
    for op, (claim, canceled_now) in zip(ops, results, strict=True):
        state = await state_of(pool, op)
        if claim is not None:
            assert (state, canceled_now) == ("submitting", False), op
        else:
            assert state == "canceled", op
    assert await pool.fetchval("SELECT count(*) FROM cancellations WHERE operation_id LIKE 'op-race-%'") == 40


async def test_a_running_job_is_canceled_at_the_provider_once_and_has_no_outputs(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await simulator.configure(compression=1.0)  # real time: the job is still going when the cancel arrives
    job_id = await submitted_operation(runtime, "op-cr", generated=200)
    ask = await runtime.ledger.request_cancel("op-cr", CancelPath.TOPIC, "app", "user left")
    assert ask.state_when_asked is OperationState.SUBMITTED and not ask.canceled_now
    assert await observe_until(runtime, pool, "op-cr", {"canceled", "succeeded"}) == "canceled"
    [job] = (await simulator.get("/_sim/operations/op-cr"))["jobs"]
    assert (job["job_id"], job["cancels"], job["status"]) == (job_id, 1, "canceled")
    assert await cancel_calls(pool, "op-cr") == ["cancel_accepted"]
    assert await delivered_outputs(pool, "op-cr") == 0
    assert await pool.fetchval("SELECT count(*) FROM outputs WHERE operation_id='op-cr'") == 0
    assert await pool.fetchval("SELECT outcome FROM remote_jobs WHERE remote_job_id=$1", job_id) == "canceled"


async def test_a_job_that_succeeded_first_stays_succeeded_and_delivers_its_outputs(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    job_id = await submitted_operation(runtime, "op-cs")

    async def done() -> bool:
        jobs = (await simulator.get("/_sim/operations/op-cs"))["jobs"]
        return bool(jobs[0]["status"] == "succeeded")

    await wait_for(done, 10, "the job to succeed at the provider")
    await runtime.ledger.request_cancel("op-cs", CancelPath.TOPIC, "app", "too late")
    assert await observe_until(runtime, pool, "op-cs", {"canceled", "succeeded"}) == "succeeded"
    assert await cancel_calls(pool, "op-cs") == ["cancel_already_terminal"]
    [job] = (await simulator.get("/_sim/operations/op-cs"))["jobs"]
    assert job["job_id"] == job_id and await delivered_outputs(pool, "op-cs") == job["outputs"]


async def test_a_cancel_while_submitting_is_applied_once_the_post_answer_is_saved(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """The cancel vs the POST's answer: recorded while submitting, the POST's job id saved after it, then the job is
    canceled at the provider."""
    await simulator.configure(compression=1.0)
    request = '{"input": {"prompt": "ten words of a prompt for a job to run on", "max_tokens": 200}}'
    assert await runtime.ledger.accept("op-csub", request, submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit("op-csub")
    assert fencing is not None
    ask = await runtime.ledger.request_cancel("op-csub", CancelPath.OPERATOR, "bob", "wrong prompt")
    assert ask.state_when_asked is OperationState.SUBMITTING and not ask.canceled_now
    result = await runtime.remote.submit("op-csub", request)
    assert await runtime.ledger.save_submitted("op-csub", fencing, result.job_id, 0.0, None)
    assert await observe_until(runtime, pool, "op-csub", {"canceled", "succeeded"}) == "canceled"
    assert await cancel_calls(pool, "op-csub") == ["cancel_accepted"]


async def test_uncertain_records_the_cancel_and_applies_it_when_a_job_is_adopted(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await simulator.configure(compression=1.0)
    request = '{"input": {"prompt": "ten words of a prompt for a job to run on", "max_tokens": 200}}'
    assert await runtime.ledger.accept("op-cu", request, submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit("op-cu")
    assert fencing is not None
    result = await runtime.remote.submit("op-cu", request)  # its answer "lost": uncertain
    assert await runtime.ledger.save_submission_without_job(
        "op-cu", fencing, OperationState.UNCERTAIN, "lost", ReasonCode.UNKNOWN_OUTCOME
    )
    ask = await runtime.ledger.request_cancel("op-cu", CancelPath.TOPIC, "app", "not needed")
    assert ask.state_when_asked is OperationState.UNCERTAIN and await state_of(pool, "op-cu") == "uncertain"
    assert await runtime.ledger.save_submitted("op-cu", fencing, result.job_id, 0.0, None)  # the late answer
    assert await observe_until(runtime, pool, "op-cu", {"canceled", "succeeded"}) == "canceled"
    assert await cancel_calls(pool, "op-cu") == ["cancel_accepted"]


async def test_a_terminal_operation_records_the_cancel_and_keeps_its_state(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await submitted_operation(runtime, "op-ct")
    assert await observe_until(runtime, pool, "op-ct", {"succeeded"}) == "succeeded"
    ask = await runtime.ledger.request_cancel("op-ct", CancelPath.TOPIC, "app", "after the fact")
    again = await runtime.ledger.request_cancel("op-ct", CancelPath.OPERATOR, "carol", "again")
    assert (ask.state_when_asked, ask.recorded, again.recorded) == (OperationState.SUCCEEDED, True, False)
    assert await state_of(pool, "op-ct") == "succeeded" and await cancel_calls(pool, "op-ct") == []


async def next_poll_in_s(pool: asyncpg.Pool, op: str) -> float:
    """Seconds from the database's now until the operation's next poll (negative: due)."""
    return float(
        await pool.fetchval(
            "SELECT extract(epoch FROM next_poll_at - now())::float8 FROM operations WHERE operation_id=$1", op
        )
    )


async def test_a_cancel_of_a_polled_job_calls_the_provider_before_its_next_poll(
    settings: Settings,
    pool: asyncpg.Pool,
    simulator: Simulator,
    kafka_send: Callable[[str, bytes, bytes], Awaitable[Any]],
) -> None:
    """A job polled every 30 s, its worker's scheduler asleep (no fallback within the test): the cancellation makes
    the poll due and wakes the scheduler, so the provider sees the cancel call long before the next poll."""
    await simulator.configure(compression=1.0, queue_ms=600_000, poll_max_ms=200)  # queued all along
    s = settings.replace(
        poll_min_delay_s=LONG_POLL_S,
        poll_backoff_cap_s=LONG_POLL_S,
        wakeup_fallback_s=3600.0,
        wakeup_listening_fallback_s=3600.0,
    )
    rt = await Runtime.create(s, kafka_send, worker="cancel-worker")
    woken = metrics.WAKEUPS.labels("schedule_polls", CANCEL)
    try:
        job_id = await submitted_operation(rt, "op-cnow")  # due now: the first round below polls it
        async with polling(rt, 3600.0):

            async def polled_once() -> bool:
                return bool(await pool.fetchval("SELECT poll_count FROM operations WHERE operation_id='op-cnow'"))

            await wait_for(polled_once, 10, "the job's first poll")
            assert await next_poll_in_s(pool, "op-cnow") > LONG_POLL_S - 5
            next_poll_at = float(
                await pool.fetchval(
                    "SELECT extract(epoch FROM next_poll_at) FROM operations WHERE operation_id='op-cnow'"
                )
            )
            woken_before = woken._value.get()
            await Canceller(rt).handle(cancellation("op-cnow"))

            async def canceled() -> bool:
                return await state_of(pool, "op-cnow") == "canceled"

            await wait_for(canceled, 10, "the job canceled at the provider and observed canceled")
        [job] = (await simulator.get("/_sim/operations/op-cnow"))["jobs"]
        assert (job["job_id"], job["cancels"], job["status"]) == (job_id, 1, "canceled")
        assert job["canceled_at"] < next_poll_at - (LONG_POLL_S - 10)
        assert woken._value.get() == woken_before + 1
        assert await cancel_calls(pool, "op-cnow") == ["cancel_accepted"]
    finally:
        await rt.close()


async def test_an_operators_cancel_makes_the_jobs_poll_due_for_any_scheduler(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """``streams operations cancel`` runs outside any worker: the poll is due in the ledger, so a scheduler's next
    round claims it (here the test's own round)."""
    await simulator.configure(compression=1.0, queue_ms=600_000)
    await submitted_operation(runtime, "op-cop")
    await pool.execute("UPDATE operations SET next_poll_at = now() + interval '30 s' WHERE operation_id='op-cop'")
    ask = await Ledger(pool, "operator:alice").request_cancel("op-cop", CancelPath.OPERATOR, "alice", "wrong prompt")
    assert (ask.state_when_asked, ask.recorded, ask.poll_made_due) == (OperationState.SUBMITTED, True, True)
    assert await next_poll_in_s(pool, "op-cop") <= 0
    await Observer(runtime).handle(await claim_poll(runtime, "op-cop"))  # the round claims it: due
    assert await cancel_calls(pool, "op-cop") == ["cancel_accepted"]
    assert await state_of(pool, "op-cop") == "canceled"
    again = await Ledger(pool, "operator:bob").request_cancel("op-cop", CancelPath.OPERATOR, "bob", "again")
    assert (again.recorded, again.poll_made_due) == (False, False)  # a repeat writes nothing


async def test_a_cancel_during_a_poll_leaves_the_next_poll_due_at_once(runtime: Runtime, pool: asyncpg.Pool) -> None:
    """A cancellation recorded while the job's poll is being observed (its claim read no cancellation): the save
    of that poll keeps the next one due now, not after the poll's delay; once the route was called, the delay
    applies again."""
    assert await runtime.ledger.accept("op-cmid", REQUEST, submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit("op-cmid")
    assert fencing is not None
    assert await runtime.ledger.save_submitted("op-cmid", fencing, "job-cmid", 0.0, None)
    [poll] = [p for p in await runtime.ledger.claim_due_polls(100, 60.0) if p.operation_id == "op-cmid"]
    claim = await runtime.ledger.claim_for_observe("op-cmid", poll.poll_claim_id, uuid.uuid4())
    assert claim is not None and not claim.cancel_asked
    ask = await runtime.ledger.request_cancel("op-cmid", CancelPath.TOPIC, "app", "mid poll")
    assert ask.poll_made_due
    running = JobSnapshot(job_id="job-cmid", status="running", state=OperationState.RUNNING)
    await runtime.ledger.save_observation("op-cmid", claim.fencing_token, running, LONG_POLL_S)
    assert await next_poll_in_s(pool, "op-cmid") <= 0
    [poll] = [p for p in await runtime.ledger.claim_due_polls(100, 60.0) if p.operation_id == "op-cmid"]
    claim = await runtime.ledger.claim_for_observe("op-cmid", poll.poll_claim_id, uuid.uuid4())
    assert claim is not None and claim.cancel_asked
    assert (
        await runtime.ledger.note_cancel_call(
            "op-cmid", claim.fencing_token, RemoteCallOutcome.CANCEL_UNKNOWN_OUTCOME, False
        )
        == 1
    )
    await runtime.ledger.save_observation("op-cmid", claim.fencing_token, running, LONG_POLL_S)
    assert await next_poll_in_s(pool, "op-cmid") > LONG_POLL_S - 5


async def test_a_job_id_saved_after_a_cancel_is_polled_at_once(runtime: Runtime, pool: asyncpg.Pool) -> None:
    """Canceled while submitting: the job id's save makes the first poll due now, whatever its delay."""
    assert await runtime.ledger.accept("op-cfirst", REQUEST, submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit("op-cfirst")
    assert fencing is not None
    ask = await runtime.ledger.request_cancel("op-cfirst", CancelPath.TOPIC, "app", "before the answer")
    assert ask.state_when_asked is OperationState.SUBMITTING and not ask.poll_made_due
    assert await runtime.ledger.save_submitted("op-cfirst", fencing, "job-cfirst", LONG_POLL_S, None)
    assert await next_poll_in_s(pool, "op-cfirst") <= 0
