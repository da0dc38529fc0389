"""The seed's acceptance checks against real worker processes and real services."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from streams.clients.submit import SubmissionProducer
from streams.config import Settings
from streams_harness import faults
from streams_harness.fleet import Fleet
from streams_harness.toxiproxy import Toxiproxy
from tests.support import SimulatorServer, provider_request, services, wait_for

pytestmark = pytest.mark.e2e

FINAL = ("succeeded", "failed", "canceled", "rejected", "uncertain")


async def submit(producer: SubmissionProducer, prefix: str, n: int, generated: int = 20) -> list[str]:
    ids = [f"{prefix}-{i:04d}" for i in range(n)]
    futures = [await producer.submit(op, provider_request(100, generated)) for op in ids]
    await asyncio.gather(*futures)
    return ids


async def states(pool: asyncpg.Pool, prefix: str) -> dict[str, str]:
    rows = await pool.fetch("SELECT operation_id, state::text FROM operations WHERE operation_id LIKE $1", prefix + "%")
    return {r["operation_id"]: r["state"] for r in rows}


async def all_final(pool: asyncpg.Pool, ids: list[str]) -> bool:
    n = await pool.fetchval(
        "SELECT count(*) FROM operations WHERE operation_id = ANY($1) AND state::text = ANY($2)", ids, list(FINAL)
    )
    return bool(n == len(ids))


async def test_paused_worker_save_is_refused_by_fencing(
    fleet: Fleet, sim: SimulatorServer, producer: SubmissionProducer, ledger_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """A is SIGSTOPped after its GET (and renewal), before its save, longer than the lease TTL; B
    takes the lease, observes and saves; A resumes and its save is refused by the fencing value."""
    hook = tmp_path / "pause-after-get"
    hook.touch()
    a = fleet.start("a", faults={faults.PAUSE_AFTER_GET_FILE: str(hook)})
    await fleet.wait_ready("a")
    [op] = await submit(producer, f"pause{uuid.uuid4().hex[:6]}", 1, generated=400)

    async def a_stopped() -> bool:
        return a.stopped()

    await wait_for(a_stopped, 30, "worker A to stop itself between GET and save")
    fencing_a = await ledger_pool.fetchval("SELECT fencing_token FROM operations WHERE operation_id=$1", op)
    b = fleet.start("b")
    await fleet.wait_ready("b")

    async def saved_by_b() -> bool:
        return (
            await ledger_pool.fetchval("SELECT state = 'succeeded' FROM operations WHERE operation_id=$1", op) is True
        )

    await wait_for(saved_by_b, 60, "worker B to observe and save succeeded")
    row = await ledger_pool.fetchrow(
        "SELECT fencing_token, updated_by, last_observation FROM operations WHERE operation_id=$1", op
    )
    assert row["fencing_token"] > fencing_a
    assert row["updated_by"].endswith(f":{b.pid}")
    a.signal(signal.SIGCONT)

    async def a_refused() -> bool:
        return await a.metric("streams_fencing_refusals_total", {"stage": "observe"}) == 1.0

    await wait_for(a_refused, 30, "worker A's save to be refused and counted")
    after = await ledger_pool.fetchrow(
        "SELECT state::text, fencing_token, updated_by FROM operations WHERE operation_id=$1", op
    )
    assert (after["state"], after["fencing_token"], after["updated_by"]) == (
        "succeeded",
        row["fencing_token"],
        row["updated_by"],
    )
    assert "fencing value" in a.log_text()
    jobs = (await sim.get(f"/_sim/operations/{op}"))["jobs"]
    assert len(jobs) == 1 and jobs[0]["max_gets_in_flight"] == 1


@pytest.mark.parametrize("mode", ["stopped", "silent"])
async def test_redis_unavailable_stops_claims_and_resumes(
    mode: str,
    fault_settings: Settings,
    tmp_path: Path,
    sim: SimulatorServer,
    ledger_pool: asyncpg.Pool,
    producer: SubmissionProducer,
) -> None:
    """Redis refused (server stopped) or accepting but silent: zero POSTs and GETs while down, no
    state change, and every operation finishes by itself when it returns."""
    Toxiproxy.ensure_running()
    toxi = Toxiproxy()
    name = f"redis-{uuid.uuid4().hex[:6]}"
    port = await toxi.create(name, "127.0.0.1:6379")
    fleet = Fleet(fault_settings.replace(redis_url=f"redis://127.0.0.1:{port}/0"), tmp_path)
    try:
        fleet.start("a")
        fleet.start("b")
        await fleet.wait_ready()
        prefix = f"redis{mode}{uuid.uuid4().hex[:6]}"
        first = await submit(producer, prefix + "-a", 10, generated=200)  # in flight when Redis goes away
        await wait_for(lambda: _count_posts(sim, first), 30, "first batch POSTed")
        if mode == "stopped":
            await toxi.enable(name, False)
        else:
            await toxi.blackhole(name, True)
        await asyncio.sleep(fault_settings.redis_socket_timeout_s * 2)  # let calls in flight finish
        before = await sim.get("/_sim/summary")
        snapshot = await states(ledger_pool, prefix)
        second = await submit(producer, prefix + "-b", 10)
        await asyncio.sleep(5.0)  # the outage lasts 5 s: longer than a lease TTL and a visibility timeout
        during = await sim.get("/_sim/summary")
        assert (during["posts"], during["gets"]) == (before["posts"], before["gets"])
        now = await states(ledger_pool, prefix)
        assert {op: s for op, s in now.items() if op in snapshot} == snapshot  # no state changed
        assert all(now.get(op, "accepted") == "accepted" for op in second)  # new work waits, accepted at most
        if mode == "stopped":
            await toxi.enable(name, True)
        else:
            await toxi.blackhole(name, False)
        await wait_for(lambda: all_final(ledger_pool, first + second), 90, "every operation final after Redis returns")
        final = await states(ledger_pool, prefix)
        assert set(final) == set(first + second)
        assert set(final.values()) == {"succeeded"}
        summary = await sim.get("/_sim/summary")
        assert summary["max_jobs_per_operation"] == 1 and summary["max_gets_in_flight_per_job"] == 1
    finally:
        fleet.stop_all()
        await toxi.delete(name)


async def _count_posts(sim: SimulatorServer, ids: list[str]) -> bool:
    return int((await sim.get("/_sim/summary"))["posts"]) >= len(ids)


async def test_redis_restarted_empty_keeps_ledger_and_creates_nothing(
    fleet: Fleet, sim: SimulatorServer, ledger_pool: asyncpg.Pool, producer: SubmissionProducer
) -> None:
    """FLUSHALL and a real restart: durable records intact, no new remote creation for operations
    that already had a job id, fencing values keep increasing, polling resumes."""
    fleet.start("a")
    await fleet.wait_ready()
    assert fleet.settings.first_poll_in_process_max_s == 1.0
    # jobs of about 1.26 s (the simulator's 200 ms queue and 25 ms per token, compressed 20x): the first poll's hint
    # is past first_poll_in_process_max_s, so every observation is claimed after the job id's save
    ids = await submit(producer, f"flush{uuid.uuid4().hex[:6]}", 20, generated=1000)

    async def all_have_jobs() -> bool:
        n = await ledger_pool.fetchval(
            "SELECT count(*) FROM operations WHERE operation_id = ANY($1) AND remote_job_id IS NOT NULL", ids
        )
        return bool(n == len(ids))

    await wait_for(all_have_jobs, 30, "every operation to have a job id")
    before = {
        r["operation_id"]: (r["remote_job_id"], r["fencing_token"])
        for r in await ledger_pool.fetch(
            "SELECT operation_id, remote_job_id, fencing_token FROM operations WHERE operation_id = ANY($1)", ids
        )
    }
    import redis.asyncio as aioredis

    client: Any = aioredis.Redis.from_url(fleet.settings.redis_url.get_secret_value())
    await client.flushall()
    await client.aclose()
    services("restart", "redis")
    await wait_for(lambda: all_final(ledger_pool, ids), 90, "every operation final after the Redis restart")
    after = {
        r["operation_id"]: (r["remote_job_id"], r["fencing_token"], r["state"])
        for r in await ledger_pool.fetch(
            "SELECT operation_id, remote_job_id, fencing_token, state::text AS state FROM operations"
            " WHERE operation_id = ANY($1)",
            ids,
        )
    }
    for op, (job_id, fencing) in before.items():
        assert after[op][0] == job_id
        assert after[op][1] > fencing
        assert after[op][2] == "succeeded"
    summary = await sim.get("/_sim/summary")
    assert summary["jobs_created"] == len(ids) and summary["max_jobs_per_operation"] == 1


async def test_dispatcher_killed_mid_post_ends_uncertain_with_one_post(
    fleet: Fleet, sim: SimulatorServer, ledger_pool: asyncpg.Pool, producer: SubmissionProducer
) -> None:
    """SIGKILL after the remote job was created, before the response was saved: uncertain, with a
    reason, and the simulator saw exactly one POST for it."""
    await sim.configure(fault_slow=1.0, slow_response_s=30.0)
    a = fleet.start("a")
    await fleet.wait_ready("a")
    [op] = await submit(producer, f"kill{uuid.uuid4().hex[:6]}", 1)

    async def created() -> bool:
        return len((await sim.get(f"/_sim/operations/{op}"))["jobs"]) == 1

    await wait_for(created, 30, "the job to be created (response still pending)")
    a.signal(signal.SIGKILL)
    a.proc.wait()
    await sim.configure(fault_slow=0.0)
    fleet.start("b")
    await fleet.wait_ready("b")

    async def uncertain() -> bool:
        state: str = await ledger_pool.fetchval("SELECT state::text FROM operations WHERE operation_id=$1", op)
        return state == "uncertain"

    await wait_for(uncertain, 60, "reconciliation to mark the operation uncertain")
    reason = await ledger_pool.fetchval("SELECT reason FROM operations WHERE operation_id=$1", op)
    assert "dispatcher died or lost contact" in reason
    record = await sim.get(f"/_sim/operations/{op}")
    assert record["posts"] == 1 and len(record["jobs"]) == 1
