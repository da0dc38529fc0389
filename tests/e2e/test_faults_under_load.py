"""Faults under load: rebalances, and Kafka and PostgreSQL restarts."""

from __future__ import annotations

import asyncio
import re
import signal
import uuid
from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from streams.clients.submit import SubmissionProducer
from streams_harness.fleet import Fleet
from tests.support import SimulatorServer, provider_request, services, wait_for

pytestmark = pytest.mark.e2e

FINAL = ("succeeded", "failed", "canceled", "rejected", "uncertain")


async def trickle(producer: SubmissionProducer, prefix: str, n: int, per_s: float) -> list[str]:
    """Publish ``n`` submissions at ``per_s`` per second; returns their operation ids."""
    ids = []
    futures = []
    for i in range(n):
        op = f"{prefix}-{i:05d}"
        futures.append(await producer.submit(op, provider_request(500, 50 + (i % 7) * 40)))
        ids.append(op)
        await asyncio.sleep(1.0 / per_s)
    await asyncio.gather(*futures)
    return ids


#: The reasons an operation becomes uncertain (streams.remote.client, streams.worker.stages.dispatcher, the
# reconciliation).
UNKNOWN_OUTCOME = re.compile(
    r"timed out after send|connection lost after send|without error\.job_id|without a usable job id"
    r"|could not be saved|no outcome saved within"
)


async def check_promises(pool: asyncpg.Pool, sim: SimulatorServer, ids: list[str], timeout_s: float) -> None:
    async def done() -> bool:
        n = await pool.fetchval(
            "SELECT count(*) FROM operations WHERE operation_id = ANY($1) AND state::text = ANY($2)", ids, list(FINAL)
        )
        return bool(n == len(ids))

    try:
        await wait_for(done, timeout_s, f"all {len(ids)} operations final")
    except AssertionError as exc:  # say which operations are stuck where, so that a failure in CI can be read
        stuck = await pool.fetch(
            "SELECT operation_id, state::text AS state, fencing_token, next_poll_at, updated_at FROM operations "
            "WHERE operation_id = ANY($1) AND NOT state::text = ANY($2) ORDER BY operation_id LIMIT 20",
            ids,
            list(FINAL),
        )
        missing = len(ids) - await pool.fetchval("SELECT count(*) FROM operations WHERE operation_id = ANY($1)", ids)
        states = [dict(r) for r in stuck]
        raise AssertionError(f"{exc}; not in the ledger: {missing}; not final (first 20): {states}") from exc
    rows = await pool.fetch(
        "SELECT operation_id, state::text AS state, reason FROM operations WHERE operation_id = ANY($1)", ids
    )
    assert len(rows) == len(ids)  # nothing lost
    # every uncertain operation says which unknown outcome it met (a reason is never missing: the schema checks it)
    unexplained = [r["reason"] for r in rows if r["state"] == "uncertain" and not UNKNOWN_OUTCOME.search(r["reason"])]
    assert unexplained == []
    summary = await sim.get("/_sim/summary")
    assert summary["max_jobs_per_operation"] <= 1
    assert summary["max_gets_in_flight_per_job"] == 1
    jobs = (await sim.get("/_sim/jobs"))["jobs"]
    job_ops = [j["client_reference"] for j in jobs]
    assert len(job_ops) == len(set(job_ops))  # no operation created twice
    succeeded = [r["operation_id"] for r in rows if r["state"] == "succeeded"]
    undelivered = await pool.fetchval(
        "SELECT count(*) FROM outbox WHERE operation_id = ANY($1) AND published_at IS NULL", succeeded
    )

    async def drained() -> bool:
        left: int = await pool.fetchval(
            "SELECT count(*) FROM outbox WHERE operation_id = ANY($1) AND published_at IS NULL", succeeded
        )
        return left == 0

    if undelivered:
        await wait_for(drained, 30, "outbox drained")


async def test_rebalance_under_load(
    fleet: Fleet, sim: SimulatorServer, ledger_pool: asyncpg.Pool, producer: SubmissionProducer
) -> None:
    """A third worker joins and one is SIGKILLed while 300 operations flow."""
    fleet.start("a")
    fleet.start("b")
    await fleet.wait_ready()
    prefix = f"reb{uuid.uuid4().hex[:6]}"
    load = asyncio.create_task(trickle(producer, prefix, 300, 60.0))

    def accepted(n: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            count = await ledger_pool.fetchval(
                "SELECT count(*) FROM operations WHERE operation_id LIKE $1", prefix + "%"
            )
            return int(count) >= n

        return check

    await wait_for(accepted(90), 60, "90 operations accepted before the third worker joins")
    fleet.start("c")
    await wait_for(accepted(180), 60, "180 operations accepted before a worker is killed")
    fleet.workers["a"].signal(signal.SIGKILL)
    ids = await load
    await check_promises(ledger_pool, sim, ids, 120)


@pytest.mark.parametrize("service", ["kafka", "postgres"])
async def test_service_restart_under_load(
    service: str, fleet: Fleet, sim: SimulatorServer, ledger_pool: asyncpg.Pool, producer: SubmissionProducer
) -> None:
    """The Kafka broker, or PostgreSQL, restarted during load; workers recover by themselves."""
    fleet.start("a")
    fleet.start("b")
    await fleet.wait_ready()
    prefix = f"{service}{uuid.uuid4().hex[:6]}"
    first = await trickle(producer, prefix + "-a", 100, 80.0)
    await asyncio.to_thread(services, "restart", service)
    second = await trickle(producer, prefix + "-b", 100, 80.0)
    await check_promises(ledger_pool, sim, first + second, 180)
