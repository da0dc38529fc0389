"""Three workers, one 120 s ahead and one 120 s behind (libfaketime), against a provider whose 429s and poll hints
are HTTP-dates: each reads them against the answer's Date, so the skewed workers make as many GETs per operation
as the one on time, no pause one of them sets stops the fleet, and each exports its measured skew."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from streams.clients.submit import SubmissionProducer
from streams.config import Settings
from streams.setup.admin import create_topics, delete_topics
from streams_harness.fleet import Fleet, faketime_env
from streams_harness.services import wait_group_stable
from tests.support import ROOM_FOR_CALLS, SimulatorServer, provider_request, unique_settings, wait_for

pytestmark = pytest.mark.e2e

#: Each worker's wall clock against the machine's (libfaketime's relative offsets, seconds).
SHIFTS_S = {"on-time": 0.0, "ahead": 120.0, "behind": -120.0}
#: The provider's POST limit (per s, burst), the workers' shared POST budget a little above it (so bursts meet
#: 429s, and the budget's pace after a pause keeps the retries from herding), and the demand: bursts above both
#: bursts, an average well under the rate, so the backlog does not grow.
LIMIT_POST_PER_S, LIMIT_BURST = 8.0, 4
BUDGET_POST_PER_S, BUDGET_BURST = 9.0, 6
BATCH, BATCH_EVERY_S, OPERATIONS = 10, 2.5, 200
#: The longest pause one worker may share (s); the limit's own Retry-After is at most 1 s (rounded to whole
#: seconds against the Date, so at most 2 s read).
PAUSE_CAP_S = 5.0
LEGIT_PAUSE_S = 2.0
#: How far a skewed worker's GETs per operation may stand from the on-time worker's (a fraction of it). Each worker
#: observes a different draw of about 65 jobs, so correct workers differ by up to about 10%. A date read against
#: the worker's own clock moves it by far more: 120 s ahead, every hint reads as past and the job is polled every
#: ``poll_min_delay_s`` (several times the GETs); 120 s behind, every hint reads as ``poll_backoff_cap_s`` (30 s)
#: away and a job of about 3 s is seen done at its first GET (about a third of the GETs).
GETS_PER_OP_SPREAD = 0.3

#: Partitions of each topic: two for each of the three workers (with fewer, one may get none of generation.polls).
PARTITIONS = 6

PAUSE_LINE = re.compile(r"every worker's POSTs paused for ([0-9.]+) s, set by (\S+?)[\"\s]")


@pytest.fixture
async def six_partitions(fault_settings: Settings) -> AsyncIterator[Settings]:
    """The test's settings with topics of :data:`PARTITIONS` partitions of their own."""
    settings = unique_settings(fault_settings, partitions=PARTITIONS)
    await create_topics(settings)
    yield settings
    await delete_topics(settings)


@pytest.fixture
async def fleet6(six_partitions: Settings, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(six_partitions, tmp_path)
    yield f
    f.stop_all()


@pytest.fixture
async def producer6(six_partitions: Settings) -> AsyncIterator[SubmissionProducer]:
    async with SubmissionProducer(six_partitions) as p:
        yield p


async def test_skewed_workers_poll_alike_and_pause_no_one(
    fleet6: Fleet, sim: SimulatorServer, ledger_pool: asyncpg.Pool, producer6: SubmissionProducer
) -> None:
    fleet, producer = fleet6, producer6
    await sim.configure(
        compression=1.0,  # jobs of about 3.2 s, poll hints of at most 1 s: the hints decide the GETs
        poll_max_ms=1000,
        retry_after_dates=True,
        rate_limit_post_per_s=LIMIT_POST_PER_S,
        rate_limit_burst=LIMIT_BURST,
        multi_output_rate=0.0,
    )
    overrides: dict[str, Any] = {
        "submit_retry_deadline_s": 20.0,
        "submitting_stale_after_s": 40.0,
        "remote_shared_pause_cap_s": PAUSE_CAP_S,
        "remote_post_rate_per_s": BUDGET_POST_PER_S,
        "remote_post_burst": BUDGET_BURST,
        **ROOM_FOR_CALLS,
    }
    for name, shift_s in SHIFTS_S.items():
        # the one on time too, at +0 s: every worker pays libfaketime's cost on each clock read alike
        fleet.start(name, env=faketime_env(f"{shift_s:+.0f}s"), **overrides)
    await fleet.wait_ready()
    assert await wait_group_stable(fleet.settings, 3, 60)

    # Each worker measured its clock against PostgreSQL's at start.
    skews = {name: await w.metric("streams_clock_skew_seconds") for name, w in fleet.workers.items()}
    for name, shift_s in SHIFTS_S.items():
        assert abs(skews[name] - shift_s) < 1.0, skews

    prefix = f"sk{uuid.uuid4().hex[:6]}"
    ids = [f"{prefix}-{i:04d}" for i in range(OPERATIONS)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    acks = []
    for b in range(0, OPERATIONS, BATCH):
        acks += [await producer.submit(op, provider_request(300, 120)) for op in ids[b : b + BATCH]]
        await asyncio.sleep(max(0.0, started + (b // BATCH + 1) * BATCH_EVERY_S - loop.time()))
    await asyncio.gather(*acks)

    async def all_final() -> bool:
        n = await ledger_pool.fetchval(
            "SELECT count(*) FROM operations WHERE operation_id = ANY($1) AND state::text = ANY($2)",
            ids,
            ["succeeded", "failed", "canceled", "rejected", "uncertain", "stalled"],
        )
        return bool(n == len(ids))

    await wait_for(all_final, 150, f"all {len(ids)} operations final")
    states = await ledger_pool.fetch(
        "SELECT state::text AS state, count(*) AS n FROM operations WHERE operation_id = ANY($1) GROUP BY 1", ids
    )
    summary = await sim.get("/_sim/summary")
    assert summary["rate_limit_429s"]["POST"] > 0  # the bursts were refused: every worker read dated 429s
    assert (summary["jobs_created"], summary["max_jobs_per_operation"]) == (len(ids), 1)

    by_pid = {str(w.pid): name for name, w in fleet.workers.items()}
    rows = await ledger_pool.fetch(
        "SELECT worker, count(*) AS gets, count(DISTINCT operation_id) AS operations FROM remote_calls "
        "WHERE method = 'GET' AND operation_id = ANY($1) GROUP BY worker",
        ids,
    )
    gets_per_op = {by_pid[r["worker"].rsplit(":", 1)[1]]: r["gets"] / r["operations"] for r in rows}
    observed = {by_pid[r["worker"].rsplit(":", 1)[1]]: r["operations"] for r in rows}
    delays = await ledger_pool.fetch(
        "SELECT extract(epoch FROM t.at - o.accepted_at)::float8 AS s FROM operations o "
        "JOIN transitions t ON t.operation_id = o.operation_id AND t.to_state = 'submitted' "
        "WHERE o.operation_id = ANY($1)",
        ids,
    )
    submit_delays = sorted(r["s"] for r in delays)
    pauses: dict[str, list[float]] = {name: [] for name in fleet.workers}
    for name, worker in fleet.workers.items():
        pauses[name] = [float(m.group(1)) for m in PAUSE_LINE.finditer(worker.log_text())]
    print(
        f"\nskews {skews}\nGETs per operation {gets_per_op} (operations observed {observed})\n"
        f"POST 429s {summary['rate_limit_429s']['POST']}; shared pauses set per worker: "
        f"{ {n: (len(p), max(p, default=0.0)) for n, p in pauses.items()} } (count, longest s)\n"
        f"accepted -> submitted: median {submit_delays[len(submit_delays) // 2]:.2f} s, "
        f"p99 {submit_delays[int(len(submit_delays) * 0.99)]:.2f} s, max {submit_delays[-1]:.2f} s"
    )
    odd = await ledger_pool.fetch(
        "SELECT operation_id, state::text AS state, reason_code, reason, updated_by FROM operations "
        "WHERE operation_id = ANY($1) AND state <> 'succeeded' ORDER BY operation_id",
        ids,
    )
    odd_calls = await ledger_pool.fetch(
        "SELECT operation_id, method, status_code, outcome, duration_ms, worker, at FROM remote_calls "
        "WHERE operation_id = ANY($1) AND method = 'POST' ORDER BY id",
        [r["operation_id"] for r in odd],
    )
    assert {r["state"]: r["n"] for r in states} == {"succeeded": len(ids)}, (
        [dict(r) for r in odd],
        [dict(r) for r in odd_calls],
    )
    assert set(gets_per_op) == set(SHIFTS_S), gets_per_op
    for name in ("ahead", "behind"):
        spread = abs(gets_per_op[name] - gets_per_op["on-time"])
        assert spread <= GETS_PER_OP_SPREAD * gets_per_op["on-time"], gets_per_op
    # No pause any worker shared was longer than the provider's own Retry-After (none reached the cap) ...
    assert all(p <= LEGIT_PAUSE_S + 0.1 for ps in pauses.values() for p in ps), pauses
    # ... and no submission waited like behind a fleet-wide pause: well under the cap plus a retry.
    assert submit_delays[-1] < PAUSE_CAP_S + LEGIT_PAUSE_S, submit_delays[-10:]
