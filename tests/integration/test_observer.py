"""The observer against the real services: leases, fencing, state order, outputs with the outbox."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from collections.abc import Awaitable, Callable

import asyncpg
import orjson
import pytest

from streams import hooks, metrics
from streams.config import Settings, lease_key
from streams.ledger.records import SaveOutcome
from streams.model.answers import JobSnapshot
from streams.model.states import OperationState
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.observer import Observer
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration


async def submitted_operation(runtime: Runtime, op: str, generated: int = 5) -> str:
    """An operation with a real remote job, saved as submitted and due now; returns the job id."""
    request = f'{{"input": {{"prompt": "ten words of a prompt for a job to run on", "max_tokens": {generated}}}}}'
    assert await runtime.ledger.accept(op, request, submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit(op)
    assert fencing is not None
    result = await runtime.remote.submit(op, request)
    assert await runtime.ledger.save_submitted(op, fencing, result.job_id, 0.0, None)
    return result.job_id


async def claim_poll(runtime: Runtime, op: str) -> RawMessage:
    """Claim the due poll for ``op`` like the scheduler does and return its event."""
    polls = [p for p in await runtime.ledger.claim_due_polls(100, 3.0) if p.operation_id == op]
    assert len(polls) == 1
    p = polls[0]
    value = {
        "operation_id": op,
        "remote_job_id": p.remote_job_id,
        "poll_claim_id": p.poll_claim_id,
        "claimed_at_ms": int(time.time() * 1000),
    }
    return RawMessage("generation.polls", 0, 0, op.encode(), orjson.dumps(value))


async def state_of(pool: asyncpg.Pool, op: str) -> str:
    return str(await pool.fetchval("SELECT state::text FROM operations WHERE operation_id=$1", op))


async def test_observes_until_succeeded_and_writes_outputs_with_outbox(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    job_id = await submitted_operation(runtime, "op-obs")
    observer = Observer(runtime)

    async def terminal() -> bool:
        await pool.execute(
            "UPDATE operations SET next_poll_at = now() WHERE operation_id='op-obs'"
            " AND state IN ('submitted','queued','running')"
        )
        if await state_of(pool, "op-obs") != "succeeded":
            await observer.handle(await claim_poll(runtime, "op-obs"))
        return await state_of(pool, "op-obs") == "succeeded"

    await wait_for(terminal, 10, "operation to succeed")
    job = (await simulator.get("/_sim/operations/op-obs"))["jobs"][0]
    assert job["job_id"] == job_id and job["max_gets_in_flight"] == 1
    outputs = await pool.fetch("SELECT output_id FROM outputs WHERE operation_id='op-obs' ORDER BY position")
    outbox = await pool.fetch(
        "SELECT event_id FROM outbox WHERE operation_id='op-obs' AND topic_role='outputs_delivered' ORDER BY id"
    )
    assert [r["output_id"] for r in outputs] == [f"out_{i}" for i in range(job["outputs"])]
    assert [r["event_id"] for r in outbox] == [f"output:op-obs:{r['output_id']}" for r in outputs]
    assert await pool.fetchval("SELECT next_poll_at FROM operations WHERE operation_id='op-obs'") is None


async def test_lease_busy_reschedules_without_get(runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator) -> None:
    await submitted_operation(runtime, "op-busy")
    poll = await claim_poll(runtime, "op-busy")
    other = await runtime.leases.acquire(lease_key(runtime.settings, "observe", "op-busy"))
    assert other is not None
    before = metrics.LEASE_BUSY.labels("observe")._value.get()
    handled_from = await pool.fetchval("SELECT clock_timestamp()")
    await Observer(runtime).handle(poll)
    handled_until = await pool.fetchval("SELECT clock_timestamp()")
    job = (await simulator.get("/_sim/operations/op-busy"))["jobs"][0]
    assert job["gets"] == 0
    assert metrics.LEASE_BUSY.labels("observe")._value.get() == before + 1
    next_poll_at = await pool.fetchval("SELECT next_poll_at FROM operations WHERE operation_id='op-busy'")
    # rescheduled lease_busy_retry_s after the busy lease was met, not at the visibility timeout (bounds taken from
    # the database's clock around the handling, so a slow machine cannot move them)
    retry = dt.timedelta(seconds=runtime.settings.lease_busy_retry_s)
    assert handled_from < next_poll_at <= handled_until + retry
    await other.release()


async def test_redis_down_means_no_get_and_the_poll_comes_back(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await submitted_operation(runtime, "op-noredis")
    poll = await claim_poll(runtime, "op-noredis")
    from streams.coordination.lease import LeaseManager, make_redis

    down = make_redis("redis://127.0.0.1:1/0", 0.3)
    real = runtime.leases
    runtime.leases = LeaseManager(down, 1000)
    try:
        await Observer(runtime).handle(poll)
    finally:
        runtime.leases = real
        await down.aclose()
    assert (await simulator.get("/_sim/operations/op-noredis"))["jobs"][0]["gets"] == 0
    assert await state_of(pool, "op-noredis") == "submitted"
    delay = await pool.fetchval(
        "SELECT extract(epoch FROM next_poll_at - now()) FROM operations WHERE operation_id='op-noredis'"
    )
    assert 2.0 < delay <= 3.0  # still claimed for its visibility timeout: it comes back by itself


async def test_stale_fencing_value_is_refused_and_counted(runtime: Runtime, pool: asyncpg.Pool) -> None:
    job_id = await submitted_operation(runtime, "op-fence")
    poll = await claim_poll(runtime, "op-fence")
    claim_id = orjson.loads(poll.value or b"")["poll_claim_id"]
    first = await runtime.ledger.claim_for_observe("op-fence", claim_id)
    assert first is not None
    assert await runtime.ledger.claim_for_observe("op-fence", claim_id) is None  # a poll claim is observed once
    assert await runtime.ledger.reschedule_poll("op-fence", claim_id, 0.0)  # due again now: a newer poll claim
    again = orjson.loads((await claim_poll(runtime, "op-fence")).value or b"")["poll_claim_id"]
    second = await runtime.ledger.claim_for_observe("op-fence", again)
    assert second is not None and second.fencing_token == first.fencing_token + 1
    succeeded = JobSnapshot(job_id, "succeeded", OperationState.SUCCEEDED, outputs=[{"id": "out_0"}], completed_at_ms=1)
    running = JobSnapshot(job_id, "running", OperationState.RUNNING)
    assert await runtime.ledger.save_observation("op-fence", second.fencing_token, succeeded, None) is SaveOutcome.SAVED
    assert (
        await runtime.ledger.save_observation("op-fence", first.fencing_token, running, 1.0)
        is SaveOutcome.REFUSED_FENCING
    )
    # a late running with the *current* fencing value is refused by the state order
    assert (
        await runtime.ledger.save_observation("op-fence", second.fencing_token, running, 1.0)
        is SaveOutcome.REFUSED_ORDER
    )
    assert await state_of(pool, "op-fence") == "succeeded"
    transitions = await pool.fetchval("SELECT count(*) FROM transitions WHERE operation_id='op-fence'")
    outbox = await pool.fetchval("SELECT count(*) FROM outbox WHERE operation_id='op-fence'")
    # a repeated succeeded save writes nothing new either
    assert (
        await runtime.ledger.save_observation("op-fence", second.fencing_token, succeeded, None)
        is SaveOutcome.REFUSED_ORDER
    )
    assert await pool.fetchval("SELECT count(*) FROM transitions WHERE operation_id='op-fence'") == transitions
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE operation_id='op-fence'") == outbox == 5


async def test_lost_lease_before_save_means_no_save_and_no_second_get(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ownership changes while the GET is in flight; the renewal before the save fails with
    LeaseLostError, nothing is saved, no second GET, and the newer holder's key is untouched."""
    await submitted_operation(runtime, "op-lost")
    poll = await claim_poll(runtime, "op-lost")
    claim_id = orjson.loads(poll.value or b"")["poll_claim_id"]
    key = lease_key(runtime.settings, "observe", "op-lost")
    lease = await runtime.leases.acquire(key)
    assert lease is not None
    real_observe = runtime.remote.observe

    async def observe_then_lose_ownership(operation_id: str, job_id: str) -> JobSnapshot:
        snapshot = await real_observe(operation_id, job_id)  # the real GET
        await runtime.leases.client.set(key, "someone-else", px=5000)  # meanwhile the lease changed hands
        return snapshot

    monkeypatch.setattr(runtime.remote, "observe", observe_then_lose_ownership)
    before = metrics.LEASE_LOST.labels("observe")._value.get()
    claim = await runtime.ledger.claim_for_observe("op-lost", claim_id)
    assert claim is not None
    await Observer(runtime)._observe("op-lost", claim_id, claim, lease)
    assert metrics.LEASE_LOST.labels("observe")._value.get() == before + 1
    assert (await simulator.get("/_sim/operations/op-lost"))["jobs"][0]["gets"] == 1
    assert await pool.fetchval("SELECT poll_count FROM operations WHERE operation_id='op-lost'") == 0
    assert await runtime.leases.client.get(key) == b"someone-else"
    assert await runtime.leases.client.pttl(key) > 4000


async def test_lost_lease_before_get_means_no_get(runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator) -> None:
    """The claim took longer than the lease's confirmation can cover (the test settings: TTL 2 s, GET deadline
    1.4 s + margin 0.5 s leave 0.1 s): the renewal before the GET is due, finds the lease lost, and no GET is made."""
    await submitted_operation(runtime, "op-lost2")
    poll = await claim_poll(runtime, "op-lost2")
    claim_id = orjson.loads(poll.value or b"")["poll_claim_id"]
    key = lease_key(runtime.settings, "observe", "op-lost2")
    lease = await runtime.leases.acquire(key)
    assert lease is not None
    await runtime.leases.client.set(key, "someone-else", px=5000)
    claim = await runtime.ledger.claim_for_observe("op-lost2", claim_id)
    assert claim is not None

    async def renewal_due() -> bool:
        return lease.renewal_due

    await wait_for(renewal_due, 5, "the lease's confirmation to fall below the GET deadline plus the margin")
    before = metrics.LEASE_LOST.labels("observe")._value.get()
    await Observer(runtime)._observe("op-lost2", claim_id, claim, lease)
    assert metrics.LEASE_LOST.labels("observe")._value.get() == before + 1
    assert (await simulator.get("/_sim/operations/op-lost2"))["jobs"][0]["gets"] == 0
    assert await pool.fetchval("SELECT poll_count FROM operations WHERE operation_id='op-lost2'") == 0
    assert await runtime.leases.client.get(key) == b"someone-else"


async def test_lease_confirmed_a_moment_ago_is_not_renewed_before_the_get_but_before_the_save(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """A lease acquired a moment ago with a TTL that covers the GET deadline plus the margin is not renewed
    before the GET (the renewal would confirm nothing): the GET goes even though the key was taken over behind
    its back (only Redis losing the key can cause that within its TTL). The renewal before the save is never
    skipped: it finds the lease lost, and nothing is saved."""
    await submitted_operation(runtime, "op-fresh")
    poll = await claim_poll(runtime, "op-fresh")
    claim_id = orjson.loads(poll.value or b"")["poll_claim_id"]
    key = lease_key(runtime.settings, "observe", "op-fresh")
    lease = await runtime.leases.acquire(key, ttl_ms=30_000)  # holds 30 s; the GET needs 1.4 s + 0.5 s
    assert lease is not None and not lease.renewal_due
    await runtime.leases.client.set(key, "someone-else", px=5000)
    claim = await runtime.ledger.claim_for_observe("op-fresh", claim_id)
    assert claim is not None
    before = metrics.LEASE_LOST.labels("observe")._value.get()
    await Observer(runtime)._observe("op-fresh", claim_id, claim, lease)
    assert (await simulator.get("/_sim/operations/op-fresh"))["jobs"][0]["gets"] == 1  # no renewal before it
    assert metrics.LEASE_LOST.labels("observe")._value.get() == before + 1  # the renewal before the save
    assert await pool.fetchval("SELECT poll_count FROM operations WHERE operation_id='op-fresh'") == 0
    assert await runtime.leases.client.get(key) == b"someone-else"


async def test_a_poll_event_delivered_again_makes_no_second_get(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """Kafka may deliver a poll event again (a rebalance before its offset was committed): the scheduler's claim is
    taken once, so the second delivery is a stale poll, not a second GET of the job."""
    await simulator.configure(fault_never_finishes=1.0)  # running after the first GET: the poll stays pollable
    await submitted_operation(runtime, "op-again")
    poll = await claim_poll(runtime, "op-again")
    observer = Observer(runtime)
    stale_before = metrics.STALE_POLLS._value.get()
    await observer.handle(poll)
    fencing_after_first = await pool.fetchval("SELECT fencing_token FROM operations WHERE operation_id='op-again'")
    await observer.handle(poll)  # the same event again
    job = (await simulator.get("/_sim/operations/op-again"))["jobs"][0]
    assert job["gets"] == 1
    assert metrics.STALE_POLLS._value.get() == stale_before + 1
    assert await pool.fetchval("SELECT fencing_token FROM operations WHERE operation_id='op-again'") == (
        fencing_after_first
    )


async def test_a_succeeded_answer_refused_over_a_later_state_still_wakes_the_relay(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, simulator: Simulator
) -> None:
    """The GET read the job succeeded with outputs, and its save was refused for order (the row already succeeded:
    say this save committed, its answer was lost and its retry refused): the outputs may wait in the outbox, so
    this worker's relay is woken at once, not 0.2 s later by the notification."""
    op = f"op-order-{time.monotonic_ns()}"
    await submitted_operation(runtime, op)

    async def job_done() -> bool:
        return bool((await simulator.get(f"/_sim/operations/{op}"))["jobs"][0]["status"] == "succeeded")

    await wait_for(job_done, 10, "the job to succeed at the provider")
    event = await claim_poll(runtime, op)

    async def moved_on(conn: asyncpg.Connection) -> None:  # another writer's save, committed first
        await conn.execute("UPDATE operations SET state = 'succeeded', next_poll_at = NULL WHERE operation_id = $1", op)

    hooks.install(hooks.HookPoint.OBSERVED_BEFORE_SAVE, lambda **_: in_own_thread(settings, moved_on))
    refused = metrics.ORDER_REFUSALS._value.get()
    try:
        assert not runtime.wakeups.outbox.notified
        await Observer(runtime).handle(event)
    finally:
        hooks.clear()
    assert metrics.ORDER_REFUSALS._value.get() == refused + 1
    assert runtime.wakeups.outbox.notified  # on the old code: no wake-up, the notification's back-up only


def in_own_thread(settings: Settings, act: Callable[[asyncpg.Connection], Awaitable[None]]) -> None:
    """Run ``act`` on a connection of its own, in a thread and event loop of its own, and wait for it: another
    writer's statement, made while this event loop is held by a synchronous hook."""

    async def run() -> None:
        conn = await asyncpg.connect(settings.database_url.get_secret_value())
        try:
            await act(conn)
        finally:
            await conn.close()

    thread = threading.Thread(target=lambda: asyncio.run(run()))
    thread.start()
    thread.join()
