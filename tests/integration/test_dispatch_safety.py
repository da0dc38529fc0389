"""The dispatcher cancelled mid-POST, and operations left ``accepted`` dispatched again from the ledger.

Real PostgreSQL, Redis and the simulator on a real socket; the simulator's own record counts the POSTs.
A cancellation is delivered to the task running :meth:`Dispatcher.handle` (what a rebalance or a stopping
worker does to an agent's handler) at three points of one submission.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable
from typing import Any

import asyncpg
import pytest

from streams.config import lease_key
from streams.ledger.records import FirstPollClaim, RemoteCall
from streams.remote.client import SubmitResult
from streams.worker.runtime import Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.scheduler import PollScheduler
from tests.integration.test_dispatcher import request_text, submission
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration


async def state_of(pool: asyncpg.Pool, op: str) -> str | None:
    state: str | None = await pool.fetchval("SELECT state::text FROM operations WHERE operation_id=$1", op)
    return state


async def posts_and_jobs(simulator: Simulator, op: str) -> tuple[int, list[str]]:
    record = await simulator.get(f"/_sim/operations/{op}")
    return record["posts"], [j["job_id"] for j in record["jobs"]]


@pytest.mark.parametrize("point", ["before_send", "after_send", "after_answer"])
async def test_cancelled_dispatcher_posts_once_and_saves_the_outcome(
    point: str, runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled before the request is sent, after it is sent and before the answer, or after the answer and
    before the save: exactly one POST, and the job id is saved (``submitted``) well before the reconciliation
    time; nothing is left in ``submitting``."""
    op = f"op-cancel-{point}"
    handler: list[asyncio.Task[None]] = []

    def cancel_handler() -> None:
        handler[0].cancel()

    if point == "before_send":
        real_submit = runtime.remote.submit

        async def submit(operation_id: str, request_text: str) -> SubmitResult:
            cancel_handler()
            await asyncio.sleep(0)  # the cancellation lands here unless the POST runs shielded from it
            return await real_submit(operation_id, request_text)

        monkeypatch.setattr(runtime.remote, "submit", submit)
    elif point == "after_answer":
        real_save = runtime.ledger.save_submitted

        async def save_submitted(
            operation_id: str,
            fencing_token: int,
            remote_job_id: str,
            first_poll_delay_s: float,
            reason: str | None,
            call: RemoteCall | None = None,
            *,
            first_poll_claim_id: uuid.UUID | None = None,
        ) -> bool | FirstPollClaim:
            cancel_handler()
            await asyncio.sleep(0)
            return await real_save(
                operation_id,
                fencing_token,
                remote_job_id,
                first_poll_delay_s,
                reason,
                call,
                first_poll_claim_id=first_poll_claim_id,
            )

        monkeypatch.setattr(runtime.ledger, "save_submitted", save_submitted)
    else:  # the simulator creates the job, then holds its answer for 1 s (the read timeout is 2 s)
        await simulator.configure(fault_slow=1.0, slow_response_s=1.0)

    handler.append(asyncio.create_task(Dispatcher(runtime).handle(submission(op))))
    if point == "after_send":

        async def created() -> bool:
            return len((await posts_and_jobs(simulator, op))[1]) == 1

        await wait_for(created, 10, "the job to be created, its answer still pending")
        assert not handler[0].done()
        cancel_handler()
    with pytest.raises(asyncio.CancelledError):
        await handler[0]

    async def submitted() -> bool:
        return await state_of(pool, op) == "submitted"

    stale_s = runtime.settings.submitting_stale_after_s
    await wait_for(submitted, stale_s / 3, "the POST's outcome saved despite the cancellation")
    posts, jobs = await posts_and_jobs(simulator, op)
    assert (posts, len(jobs)) == (1, 1)
    assert await pool.fetchval("SELECT remote_job_id FROM operations WHERE operation_id=$1", op) == jobs[0]
    assert await runtime.ledger.reconcile_stale_submitting(0.0, 100) == []  # nothing left in submitting
    assert await runtime.leases.acquire(lease_key(runtime.settings, "submit", op)) is not None  # lease released
    accounted = "SELECT method, outcome, remote_job_id FROM remote_calls WHERE operation_id = $1"
    assert [tuple(r.values()) for r in await pool.fetch(accounted, op)] == [("POST", "created", jobs[0])]


async def test_operation_left_accepted_is_dispatched_once_from_the_ledger(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """An operation accepted by a worker that died before its claim is dispatched by the scheduler once it is
    older than ``accepted_stale_after_s``: one POST, saved."""
    runtime.settings = runtime.settings.replace(accepted_stale_after_s=0.5)
    op = "op-left-accepted"
    assert await runtime.ledger.accept(op, request_text(), submitted_at_ms=1)
    assert await runtime.ledger.stale_accepted(0.5, 10) == []  # too young yet
    scheduler = PollScheduler(runtime)

    async def dispatched() -> bool:
        await scheduler.tick()
        return await state_of(pool, op) == "submitted" and not scheduler.redispatching

    await wait_for(dispatched, 10, "the scheduler to dispatch the operation left accepted")
    posts, jobs = await posts_and_jobs(simulator, op)
    assert (posts, len(jobs)) == (1, 1)
    assert await pool.fetchval("SELECT remote_job_id FROM operations WHERE operation_id=$1", op) == jobs[0]


async def test_redispatch_leaves_an_operation_whose_submit_lease_is_held(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """A held submit lease means someone is dispatching: the re-dispatch claims nothing and sends nothing;
    once the lease is released it dispatches the operation."""
    runtime.settings = runtime.settings.replace(accepted_stale_after_s=0.0)
    op = "op-lease-held"
    assert await runtime.ledger.accept(op, request_text(), submitted_at_ms=1)
    [(found, stored)] = await runtime.ledger.stale_accepted(0.0, 10)
    assert found == op
    lease = await runtime.leases.acquire(lease_key(runtime.settings, "submit", op), ttl_ms=60_000)
    assert lease is not None
    assert await Dispatcher(runtime).redispatch(op, stored) is False
    assert await state_of(pool, op) == "accepted"
    assert await posts_and_jobs(simulator, op) == (0, [])
    await lease.release()
    assert await Dispatcher(runtime).redispatch(op, stored) is True
    assert await state_of(pool, op) == "submitted"
    assert (await posts_and_jobs(simulator, op))[0] == 1


async def test_live_dispatcher_and_redispatch_racing_post_once(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """The submission events of 30 stale ``accepted`` operations are handled while the re-dispatch runs on the
    same operations, all at once: each operation gets exactly one POST."""
    runtime.settings = runtime.settings.replace(accepted_stale_after_s=0.0)
    ops = [f"op-race-{i:02d}" for i in range(30)]
    for op in ops:
        assert await runtime.ledger.accept(op, request_text(), submitted_at_ms=1)
    stale = dict(await runtime.ledger.stale_accepted(0.0, 100))
    assert set(stale) == set(ops)
    live, again = Dispatcher(runtime), Dispatcher(runtime)
    rng = random.Random(5)

    async def after(delay_s: float, work: Awaitable[Any]) -> Any:
        await asyncio.sleep(delay_s)
        return await work

    # Each side starts at once on half of the operations and 0-1,000 ms late on the other half, so that each wins
    # some of them however the machine's load shifts the two sides' pace (the live handler makes two ledger round
    # trips before its lease, the re-dispatch none: with one order only, a loaded machine let the re-dispatch win
    # all 30 from 0-100 ms behind).
    def late_s(i: int, side: int) -> float:
        return rng.uniform(0.0, 1.0) if i % 2 == side else 0.0

    results = await asyncio.gather(
        *(after(late_s(i, 0), live.handle(submission(op))) for i, op in enumerate(ops)),
        *(after(late_s(i, 1), again.redispatch(op, stale[op])) for i, op in enumerate(ops)),
    )
    redispatched = sum(1 for r in results[len(ops) :] if r)
    assert 0 < redispatched < len(ops)
    print(f"{redispatched} of {len(ops)} operations claimed by the re-dispatch, the rest by the live dispatcher")
    for op in ops:
        posts, jobs = await posts_and_jobs(simulator, op)
        assert (posts, len(jobs)) == (1, 1), op
        assert await state_of(pool, op) == "submitted"
