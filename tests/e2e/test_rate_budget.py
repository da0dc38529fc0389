"""Three worker processes share one rate budget: against a provider limit below their demand they get no 429,
and every operation still finishes with one POST."""

from __future__ import annotations

import asyncio
import bisect
import uuid
from typing import Any

import asyncpg
import pytest

from streams.clients.submit import SubmissionProducer
from streams.coordination.ratebudget import Pace
from streams_harness.fleet import Fleet
from streams_harness.services import wait_group_stable
from tests.support import ROOM_FOR_CALLS, SimulatorServer, provider_request, wait_for

pytestmark = pytest.mark.e2e

#: The simulator's per-account limit, and the workers' budget below it. The headroom absorbs the jitter on the
#: way: a request that reaches the provider up to D seconds late can bunch with the next ones, and the limit holds
#: while budget burst + budget rate * D <= limit burst. On this 2-core machine shared with other test runs a POST
#: takes up to ~0.3 s (the simulator shares the test's event loop), hence D ~ 0.5 s here.
LIMIT_POST_PER_S, LIMIT_GET_PER_S, LIMIT_BURST = 12.0, 9.0, 8
BUDGET_POST_PER_S, BUDGET_GET_PER_S, BUDGET_BURST = 8.0, 6.0, 2
#: Demand: submissions per second (above the POST limit), and how many. Each needs one POST and one or two GETs
#: (the simulator's poll hint is the job's remaining time), so the GET demand is above the GET limit too.
DEMAND_PER_S, OPERATIONS = 30.0, 150

FINAL = ["succeeded", "failed", "canceled", "rejected", "uncertain"]


def most_in_window(times: list[float], window_s: float) -> int:
    """The largest number of ``times`` (sorted) in any closed window of ``window_s`` seconds."""
    return max(bisect.bisect_right(times, t + window_s) - i for i, t in enumerate(times))


async def test_workers_under_one_budget_get_no_429_and_finish_everything(
    fleet: Fleet, sim: SimulatorServer, ledger_pool: asyncpg.Pool, producer: SubmissionProducer
) -> None:
    await sim.configure(
        rate_limit_post_per_s=LIMIT_POST_PER_S, rate_limit_get_per_s=LIMIT_GET_PER_S, rate_limit_burst=LIMIT_BURST
    )
    budget: dict[str, Any] = {  # Settings.replace overrides
        # A Redis hiccup of the loaded machine inside a claim must not use up the retry budget (rejected).
        "submit_retry_deadline_s": 20.0,
        "submitting_stale_after_s": 40.0,
        "remote_post_rate_per_s": BUDGET_POST_PER_S,
        "remote_get_rate_per_s": BUDGET_GET_PER_S,
        "remote_post_burst": BUDGET_BURST,
        "remote_get_burst": BUDGET_BURST,
        **ROOM_FOR_CALLS,
    }
    for name in ("a", "b", "c"):
        fleet.start(name, **budget)
    await fleet.wait_ready()
    assert await wait_group_stable(fleet.settings, 3, 60)  # the steady state: no rebalance while measuring
    prefix = f"rb{uuid.uuid4().hex[:6]}"
    ids, acks = [], []
    loop = asyncio.get_running_loop()
    started = loop.time()
    for i in range(OPERATIONS):
        op = f"{prefix}-{i:04d}"
        acks.append(await producer.submit(op, provider_request(300, 40 + (i % 5) * 40)))
        ids.append(op)
        await asyncio.sleep(max(0.0, started + (i + 1) / DEMAND_PER_S - loop.time()))
    await asyncio.gather(*acks)
    offered_s = loop.time() - started

    async def all_final() -> bool:
        n = await ledger_pool.fetchval(
            "SELECT count(*) FROM operations WHERE operation_id = ANY($1) AND state::text = ANY($2)", ids, FINAL
        )
        return bool(n == len(ids))

    await wait_for(all_final, 120, f"all {len(ids)} operations final")
    rows = await ledger_pool.fetch(
        "SELECT state::text AS state, reason FROM operations WHERE operation_id = ANY($1) AND state <> 'succeeded'",
        ids,
    )
    assert [dict(r) for r in rows] == []
    summary = await sim.get("/_sim/summary")
    assert summary["rate_limit_429s"] == {"POST": 0, "GET": 0}
    assert "429" not in summary["posts_by_status"]
    assert (summary["posts"], summary["jobs_created"], summary["max_jobs_per_operation"]) == (len(ids),) * 2 + (1,)
    assert summary["max_gets_in_flight_per_job"] == 1

    created = sorted(j["created_at"] for j in (await sim.get("/_sim/jobs"))["jobs"])
    post_rate = (len(created) - 1) / (created[-1] - created[0])
    done_s = created[-1] - created[0]
    waits = {
        kind: sum([await w.metric("streams_rate_budget_waits_total", {"kind": kind}) for w in fleet.workers.values()])
        for kind in ("POST", "GET", "claims")
    }
    print(
        f"\ndemand {DEMAND_PER_S:g} submissions/s for {offered_s:.1f} s; provider limit POST {LIMIT_POST_PER_S:g}/s "
        f"GET {LIMIT_GET_PER_S:g}/s burst {LIMIT_BURST}; budget POST {BUDGET_POST_PER_S:g}/s "
        f"GET {BUDGET_GET_PER_S:g}/s burst {BUDGET_BURST}\n"
        f"POSTs {summary['posts']} at {post_rate:.2f}/s over {done_s:.1f} s (most in 1 s: "
        f"{most_in_window(created, 1.0)}), GETs {summary['gets']}, 429s {summary['rate_limit_429s']}, "
        f"budget waits {waits}, all {len(ids)} succeeded in {loop.time() - started:.1f} s"
    )
    assert waits["POST"] > 0  # the demand was above the budget: the workers waited instead of being refused
    # The three workers together kept to the one budget (allowing the first POSTs, which open connections, to
    # arrive up to 1 s late) ...
    bound = Pace.from_rate(BUDGET_POST_PER_S, BUDGET_BURST).window_bound(done_s + 1.0)
    assert bound is not None and len(created) <= bound
    assert post_rate >= BUDGET_POST_PER_S * 0.7  # ... and used it
    assert waits["GET"] + waits["claims"] > 0  # polls were slowed down too
