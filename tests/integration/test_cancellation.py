"""Cancellation against PostgreSQL, Redis and the provider simulator (docs/cancellation.md): each state an
operation is canceled in, and the races with the claim, the POST's answer and the job's completion."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import orjson
import pytest

from streams.ledger.records import CancelPath
from streams.model.codes import ReasonCode
from streams.model.states import OperationState
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.canceller import Canceller
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from tests.integration.test_observer import claim_poll, state_of, submitted_operation
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration

REQUEST = '{"input": {"prompt": "ten words of a prompt for a job to run on", "max_tokens": 5}}'


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
