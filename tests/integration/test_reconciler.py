"""The reconciler against the real simulator (lookup by client reference) and ledger: one job found (adopted,
then observed as usual), none (left for a person), several (first adopted, the others recorded as duplicate
creations); lookup off; never a POST; fenced; the adoption published on generation.transitions."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from streams.clients.follow import read_topic_to_end
from streams.model.codes import ReasonCode
from streams.model.states import OperationState
from streams.worker.runtime import Runtime
from streams.worker.stages.reconciler import Reconciler
from streams.worker.stages.relay import OutboxRelay
from tests.integration.stuck import operation, poll_now, request_text, transitions
from tests.support import SimulatorServer as Simulator
from tests.support import real_ledger, wait_for

pytestmark = pytest.mark.integration

REQUEST = request_text()


async def uncertain_operation(runtime: Runtime, op: str, posts: int) -> list[str]:
    """An operation whose POST outcome the dispatcher never learned (``uncertain``), after ``posts`` real POSTs
    carrying its client reference (0: the provider created nothing). Returns the job ids created, oldest first."""
    assert await runtime.ledger.accept(op, REQUEST, submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit(op)
    assert fencing is not None
    jobs = []
    for _ in range(posts):
        jobs.append((await runtime.remote.submit(op, REQUEST)).job_id)
        # The lookup orders jobs by their creation time in whole milliseconds (then by id): two POSTs within one
        # millisecond would tie, and "oldest first" would then follow the random job ids. Wait for the next one.
        created_ms = int(time.time() * 1000)
        while int(time.time() * 1000) <= created_ms:
            await asyncio.sleep(0.0005)
    assert await runtime.ledger.save_submission_without_job(
        op,
        fencing,
        OperationState.UNCERTAIN,
        "connection lost after send; a job may exist",
        ReasonCode.UNKNOWN_OUTCOME,
    )
    return jobs


async def lookups_on(runtime: Runtime, simulator: Simulator, lag_s: float = 2.0) -> Reconciler:
    # the lag is long enough that the first tick falls inside it even on a loaded machine
    await simulator.configure(lookup_enabled=True, lookup_lag_s=0.05)
    runtime.settings = runtime.settings.replace(lookup_enabled=True, lookup_lag_s=lag_s)
    return Reconciler(runtime)


async def reconcile_until_claimed(reconciler: Reconciler) -> None:
    async def claimed() -> bool:
        return await reconciler.tick() > 0

    await wait_for(claimed, 10, "a lookup to become due and be handled")


async def accounting(pool: asyncpg.Pool, op: str) -> list[tuple[str, str]]:
    rows = await pool.fetch(
        "SELECT remote_job_id, learned_via FROM remote_jobs WHERE operation_id = $1 ORDER BY learned_at, remote_job_id",
        op,
    )
    return [(r["remote_job_id"], r["learned_via"]) for r in rows]


async def posts(simulator: Simulator, op: str) -> int:
    return int((await simulator.get(f"/_sim/operations/{op}"))["posts"])


async def test_one_job_found_is_adopted_then_observed_as_usual_and_published(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    [job] = await uncertain_operation(runtime, "op-one", posts=1)
    reconciler = await lookups_on(runtime, simulator)
    assert await reconciler.tick() == 0  # inside the provider's consistency lag: no lookup yet
    await reconcile_until_claimed(reconciler)
    row = await operation(pool, "op-one")
    assert (row["state"], row["remote_job_id"]) == ("submitted", job)
    assert row["reason"] == f"adopted job {job} found by lookup of the client reference"
    assert row["reason_code"] == "adopted_by_lookup"
    assert (await transitions(pool, "op-one"))[-1] == (4, "uncertain", "submitted")
    assert await accounting(pool, "op-one") == [(job, "lookup")]

    async def succeeded() -> bool:
        await poll_now(runtime, pool, "op-one")
        state: str = (await operation(pool, "op-one"))["state"]
        return state == "succeeded"

    await wait_for(succeeded, 10, "the adopted job to be observed to the end")
    assert await posts(simulator, "op-one") == 1  # the reconciler never POSTs
    account = await pool.fetchrow("SELECT outcome, charge_amount, charge_currency FROM remote_jobs")
    sim_job = (await simulator.get("/_sim/operations/op-one"))["jobs"][0]
    assert (account["outcome"], str(account["charge_amount"]), account["charge_currency"]) == (
        "succeeded",
        sim_job["charge_amount"],
        "USD",
    )
    await OutboxRelay(runtime).tick()
    events = [r.value for r in await read_topic_to_end(runtime.settings, "transitions")]
    adopted = [e for e in events if e["operation_id"] == "op-one" and e["from_state"] == "uncertain"]
    assert [(e["event_id"], e["to_state"], e["remote_job_id"]) for e in adopted] == [
        ("transition:op-one:4:submitted", "submitted", job)
    ]


async def test_none_found_after_the_lag_is_left_for_a_person(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await uncertain_operation(runtime, "op-none", posts=0)
    reconciler = await lookups_on(runtime, simulator)
    fencing = (await operation(pool, "op-none"))["fencing_token"]
    await reconcile_until_claimed(reconciler)
    row = await operation(pool, "op-none")
    assert row["state"] == "uncertain" and row["lookup_gave_up_at"] is not None
    assert row["reason"].startswith("not found by lookup; looked up ") and row["reason_code"] == "not_found_by_lookup"
    assert row["reason"].endswith("became uncertain: connection lost after send; a job may exist")
    assert row["fencing_token"] == fencing + 1
    assert await reconciler.tick() == 0  # looked up once after the lag; then it is a person's
    assert await posts(simulator, "op-none") == 0
    assert await accounting(pool, "op-none") == []
    summary = await real_ledger(runtime).accounting_summary()
    assert summary["needs_decision"]["uncertain"]["operations"] == 1
    move = await real_ledger(runtime).abandon("op-none", "nothing at the provider", "alice")
    assert move.to_state is OperationState.REJECTED


async def test_several_found_adopts_the_oldest_and_records_the_others_as_duplicate_creations(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    first, second, third = await uncertain_operation(runtime, "op-dup", posts=3)
    reconciler = await lookups_on(runtime, simulator)
    await reconcile_until_claimed(reconciler)
    row = await operation(pool, "op-dup")
    assert (row["state"], row["remote_job_id"]) == ("submitted", first)
    assert "2 further job(s) recorded as duplicate creations" in row["reason"]
    assert sorted(await accounting(pool, "op-dup")) == sorted(
        [(first, "lookup"), (second, "duplicate"), (third, "duplicate")]
    )
    summary = await real_ledger(runtime).accounting_summary()
    assert summary["duplicate_creations"] == 2
    assert summary["jobs_by_learned_via"] == {"lookup": 1, "duplicate": 2}
    assert await posts(simulator, "op-dup") == 3  # only the test's POSTs


async def test_lookup_off_leaves_uncertain_untouched(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await uncertain_operation(runtime, "op-off", posts=1)
    await simulator.configure(lookup_enabled=True)
    runtime.settings = runtime.settings.replace(lookup_enabled=False, lookup_lag_s=0.0)
    before = await operation(pool, "op-off")
    assert await Reconciler(runtime).tick() == 0
    after = await operation(pool, "op-off")
    assert (after["state"], after["fencing_token"], after["reason"]) == (
        "uncertain",
        before["fencing_token"],
        before["reason"],
    )
    assert (await simulator.get("/_sim/summary"))["lookups"] == 0


async def test_a_provider_without_lookup_reschedules_and_never_decides(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await uncertain_operation(runtime, "op-nolookup", posts=1)
    runtime.settings = runtime.settings.replace(lookup_enabled=True, lookup_lag_s=0.0)  # the simulator's is off
    reconciler = Reconciler(runtime)
    await reconcile_until_claimed(reconciler)
    row = await operation(pool, "op-nolookup")
    assert row["state"] == "uncertain" and row["lookup_gave_up_at"] is None
    assert row["next_lookup_at"] is not None  # tried again later
    assert row["reason"] == "connection lost after send; a job may exist"
    calls = await pool.fetch("SELECT method, status_code, outcome FROM remote_calls WHERE operation_id='op-nolookup'")
    assert [tuple(c) for c in calls][-1] == ("GET", 404, "lookup_refused")


async def test_an_adoption_after_a_newer_claim_is_refused_but_the_jobs_are_recorded(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    [job] = await uncertain_operation(runtime, "op-race", posts=1)
    await lookups_on(runtime, simulator, lag_s=0.0)
    [claim] = await runtime.ledger.claim_due_lookups(10, 0.0, 5.0)

    async def listed() -> bool:
        return bool(await runtime.remote.lookup("op-race"))

    await wait_for(listed, 5, "the job to be listed after the simulator's lag")
    found = await runtime.remote.lookup("op-race")
    await real_ledger(runtime).adopt("op-race", job, "found in the console first", "alice")  # a newer fencing value
    assert await runtime.ledger.adopt_found_job(claim, found, "adopted by lookup", 0.1) is False
    assert (await transitions(pool, "op-race"))[-1] == (4, "uncertain", "submitted")  # the operator's, once
    assert await accounting(pool, "op-race") == [(job, "adopted")]
