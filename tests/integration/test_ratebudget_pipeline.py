"""The rate budget in the pipeline, on the real services: the dispatcher waits for a POST slot before its claim,
a 429 pauses every worker's calls of its kind, the scheduler claims no more polls than the GET budget grants,
and without Redis no call is made (the calls resume when it answers)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from streams import metrics
from streams.config import Settings, budget_key, lease_key
from streams.coordination.lease import make_redis
from streams.coordination.ratebudget import BudgetKind, Pace, RateBudget
from streams.worker.runtime import Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from streams.worker.stages.reconciler import Reconciler
from streams.worker.stages.scheduler import PollScheduler
from streams_harness.fleet import free_port
from tests.integration.test_dispatcher import request_text, submission
from tests.integration.test_observer import claim_poll, submitted_operation
from tests.integration.test_reconciler import uncertain_operation
from tests.support import SimulatorServer as Simulator
from tests.support import key_exists, wait_for

pytestmark = pytest.mark.integration

Send = Callable[[str, bytes, bytes], Awaitable[Any]]

#: Time from a POST's slot to its arrival at the provider (claim, lease renewal, the request) on a loaded
#: machine, at most (s).
LATENCY_S = 0.35


@pytest.fixture
async def runtimes(
    settings: Settings, pool: asyncpg.Pool, kafka_send: Send
) -> AsyncIterator[Callable[..., Awaitable[Runtime]]]:
    """Makes worker runtimes with budget settings (same account and key prefix: one shared budget)."""
    made: list[Runtime] = []

    async def make(**budget: Any) -> Runtime:
        rt = await Runtime.create(settings.replace(**budget), kafka_send, worker=f"w{len(made)}")
        made.append(rt)
        return rt

    yield make
    for rt in made:
        await rt.close()


def counter(metric: Any, *labels: str) -> float:
    return float(metric.labels(*labels)._value.get())


async def test_post_slots_are_waited_for_before_the_claim(
    runtimes: Callable[..., Awaitable[Runtime]], pool: asyncpg.Pool, simulator: Simulator
) -> None:
    rt = await runtimes(remote_post_rate_per_s=2.0)
    dispatcher = Dispatcher(rt)
    ops = [f"op-b{i}" for i in range(3)]
    tasks = [asyncio.create_task(dispatcher.handle(submission(op))) for op in ops]

    async def first_job() -> bool:
        return bool((await simulator.get("/_sim/summary"))["jobs_created"] >= 1)

    await wait_for(first_job, 5, "the first POST")
    rows = await pool.fetch("SELECT state::text AS state FROM operations WHERE operation_id = ANY($1)", ops)
    # The others wait for their slots (0.5 s and 1 s later) still accepted: not claimed, nothing to reconcile.
    assert sum(r["state"] == "accepted" for r in rows) >= 1
    await asyncio.gather(*tasks)
    created = sorted(j["created_at"] for j in (await simulator.get("/_sim/jobs"))["jobs"])
    assert len(created) == 3
    # Slots 0.5 s apart; a POST reaches the provider after the claim and the request's own latency (the first
    # one opens its connections), which may bring two closer by that much (LATENCY_S).
    assert all(b - a >= 0.5 - LATENCY_S for a, b in itertools.pairwise(created)), created
    assert created[2] - created[0] >= 1.0 - LATENCY_S
    for op in ops:
        record = await simulator.get(f"/_sim/operations/{op}")
        assert (record["posts"], len(record["jobs"])) == (1, 1)
    states = await pool.fetch("SELECT state::text AS state FROM operations WHERE operation_id = ANY($1)", ops)
    assert [r["state"] for r in states] == ["submitted"] * 3


async def test_a_429_to_one_worker_pauses_every_workers_posts(
    runtimes: Callable[..., Awaitable[Runtime]], pool: asyncpg.Pool, simulator: Simulator
) -> None:
    worker_a, worker_b = await runtimes(), await runtimes()  # no pace: only the pause acts
    pauses = counter(metrics.BUDGET_PAUSES, "POST")
    await simulator.configure(fault_429=1.0, retry_after_s=1)
    task_a = asyncio.create_task(Dispatcher(worker_a).handle(submission("op-pa")))

    async def refused() -> bool:
        return bool((await simulator.get("/_sim/operations/op-pa"))["posts"] >= 1)

    await wait_for(refused, 5, "worker A's POST answered 429")
    await simulator.configure(fault_429=0.0)
    pause_key = budget_key(worker_a.settings, "POST", "pause")

    async def paused() -> bool:
        return bool(await worker_a.leases.client.exists(pause_key))

    await wait_for(paused, 5, "the pause in Redis")
    before = time.time()
    pause_ms = await worker_a.leases.client.pttl(pause_key)
    assert 300 < pause_ms <= 1000  # Retry-After: 1, still in force when worker B starts
    await Dispatcher(worker_b).handle(submission("op-pb"))  # worker B waits for the pause, then POSTs
    job_b = (await simulator.get("/_sim/operations/op-pb"))["jobs"][0]
    assert job_b["created_at"] >= before + pause_ms / 1000 - 0.005  # not before the pause ended
    await task_a
    record_a = await simulator.get("/_sim/operations/op-pa")
    assert record_a["post_statuses"] == [429, 201] and len(record_a["jobs"]) == 1
    assert counter(metrics.BUDGET_PAUSES, "POST") == pauses + 1


async def test_a_429_to_a_get_pauses_the_gets(
    runtimes: Callable[..., Awaitable[Runtime]], pool: asyncpg.Pool, simulator: Simulator
) -> None:
    rt = await runtimes()
    await submitted_operation(rt, "op-g", generated=2000)  # runs for a while: it stays pollable
    await simulator.configure(rate_limit_get_per_s=0.5, rate_limit_burst=1)
    observer = Observer(rt)
    due = "UPDATE operations SET next_poll_at = now() WHERE operation_id = 'op-g'"
    await observer.handle(await claim_poll(rt, "op-g"))  # GET 200: the account's one token
    await pool.execute(due)
    await observer.handle(await claim_poll(rt, "op-g"))  # GET 429, Retry-After: 2
    assert (await simulator.get("/_sim/summary"))["rate_limit_429s"]["GET"] == 1
    client = rt.leases.client
    assert 1000 < await client.pttl(budget_key(rt.settings, "GET", "pause")) <= 2000
    await pool.execute(due)
    started = time.monotonic()
    await observer.handle(await claim_poll(rt, "op-g"))  # waits out the pause, then GETs (200)
    assert time.monotonic() - started >= 1.0
    summary = await simulator.get("/_sim/summary")
    assert summary["rate_limit_429s"]["GET"] == 1 and summary["gets"] == 3


async def test_the_scheduler_claims_no_more_than_the_get_budget(
    runtimes: Callable[..., Awaitable[Runtime]], pool: asyncpg.Pool
) -> None:
    rt = await runtimes(remote_get_rate_per_s=10.0, remote_get_burst=2)
    scheduler = PollScheduler(rt)
    for _ in range(10):  # rounds with nothing due give their grants back
        assert await scheduler.tick() == 0
    for i in range(40):
        op = f"op-s{i}"
        assert await rt.ledger.accept(op, '{"input": {"prompt": "p", "max_tokens": 1}}', submitted_at_ms=0)
        fencing = await rt.ledger.claim_for_submit(op)
        assert fencing is not None
        assert await rt.ledger.save_submitted(op, fencing, f"job_s{i}", 0.0, None)
    # Interval 0.05 s: a round may claim the burst plus what falls within the round, 2 units here.
    assert await scheduler.tick() == 2
    started = time.monotonic()
    claimed = 2
    while time.monotonic() - started < 1.0:
        claimed += await scheduler.tick()
        await asyncio.sleep(0.01)
    elapsed = time.monotonic() - started
    # At most burst + rate * (elapsed + the last round's horizon), and the budget is used.
    assert 0.8 * 10.0 * elapsed <= claimed <= 2 + 10.0 * (elapsed + 0.05) + 1, (claimed, elapsed)
    assert counter(metrics.BUDGET_WAITS, "claims") > 0


async def test_no_call_without_redis_for_the_budget_then_resume(
    runtimes: Callable[..., Awaitable[Runtime]], pool: asyncpg.Pool, simulator: Simulator
) -> None:
    rt = await runtimes(remote_post_rate_per_s=5.0)
    working = rt.budget
    dead = make_redis(f"redis://127.0.0.1:{free_port()}/0", 0.5)
    rt.budget = RateBudget(dead, rt.settings)  # the budget's Redis refuses; the leases' still answers
    try:
        unavailable = counter(metrics.COORDINATION_UNAVAILABLE, "submit")
        outages = counter(metrics.OUTAGE_WAITS, "Redis", "rate budget")
        started = time.monotonic()
        task = asyncio.create_task(Dispatcher(rt).handle(submission("op-r")))

        async def retrying() -> bool:
            return counter(metrics.COORDINATION_UNAVAILABLE, "submit") >= unavailable + 4

        await wait_for(retrying, 10, "the dispatcher to wait for Redis")
        assert time.monotonic() - started >= 0.1 + 0.2 + 0.4  # a wait after each failure, doubling: no spin
        # each failure counted for the submission and reported as an outage of Redis at the rate budget
        failures = counter(metrics.COORDINATION_UNAVAILABLE, "submit") - unavailable
        assert counter(metrics.OUTAGE_WAITS, "Redis", "rate budget") - outages == failures
        assert (await simulator.get("/_sim/operations/op-r"))["posts"] == 0
        state = await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = 'op-r'")
        assert state == "accepted"  # not claimed either

        await submitted_operation(rt, "op-o", generated=2000)
        gets_before = (await simulator.get("/_sim/summary"))["gets"]
        await Observer(rt).handle(await claim_poll(rt, "op-o"))  # no GET without the budget
        assert (await simulator.get("/_sim/summary"))["gets"] == gets_before
    finally:
        rt.budget = working
        await dead.aclose()
    await task  # Redis answers again: the POST goes, once
    record = await simulator.get("/_sim/operations/op-r")
    assert (record["posts"], len(record["jobs"])) == (1, 1)
    assert await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = 'op-r'") == "submitted"


async def test_a_lookup_is_one_of_the_accounts_gets(
    runtimes: Callable[..., Awaitable[Runtime]], pool: asyncpg.Pool, simulator: Simulator
) -> None:
    rt = await runtimes(remote_get_rate_per_s=2.0, lookup_enabled=True, lookup_lag_s=0.0)
    await simulator.configure(lookup_enabled=True, lookup_lag_s=0.0)
    for op in ("op-l1", "op-l2"):
        await uncertain_operation(rt, op, posts=1)
    started = time.monotonic()
    assert await Reconciler(rt).tick() == 2  # two lookups: the second waits for its GET slot (0.5 s)
    assert time.monotonic() - started >= 0.5 - 0.01
    states = await pool.fetch("SELECT state::text AS state FROM operations WHERE operation_id IN ('op-l1', 'op-l2')")
    assert [r["state"] for r in states] == ["submitted", "submitted"]  # both adopted

    pauses = counter(metrics.BUDGET_PAUSES, "GET")
    await simulator.configure(rate_limit_get_per_s=0.2, rate_limit_burst=1)
    await uncertain_operation(rt, "op-l3", posts=1)
    await uncertain_operation(rt, "op-l4", posts=1)
    rt.budget.paces[BudgetKind.GET] = Pace.from_rate(0.0, 1)  # no pace of our own: only the provider's limit acts
    assert await Reconciler(rt).tick() == 2  # one lookup answered, the other 429 (Retry-After 5)
    assert (await simulator.get("/_sim/summary"))["rate_limit_429s"]["GET"] == 1
    assert counter(metrics.BUDGET_PAUSES, "GET") == pauses + 1
    assert 4000 < await rt.leases.client.pttl(budget_key(rt.settings, "GET", "pause")) <= 5000


# --- the submit lease while a POST slot is waited for (before the claim) ----------------------------------------


async def waiting_for_a_post_slot(rt: Runtime, op: str) -> bytes:
    """Spend the POST burst so that the next slot is 1/rate away, accept ``op``; returns its submit lease key."""
    await rt.budget.wait_for_slot(BudgetKind.POST)
    assert await rt.ledger.accept(op, request_text(), submitted_at_ms=1)
    return lease_key(rt.settings, "submit", op).encode()


async def test_submit_lease_lost_while_waiting_for_a_post_slot_claims_and_sends_nothing(
    runtimes: Callable[..., Awaitable[Runtime]], pool: asyncpg.Pool, simulator: Simulator
) -> None:
    rt = await runtimes(remote_post_rate_per_s=0.5)  # the next slot 2 s away; keep-alive every TTL/3 (0.67 s)
    key = await waiting_for_a_post_slot(rt, "op-ll")
    client = rt.leases.client
    lost = counter(metrics.LEASE_LOST, "submit")
    task = asyncio.create_task(Dispatcher(rt).redispatch("op-ll", request_text()))
    await wait_for(lambda: key_exists(client, key), 5, "the submit lease taken")
    taken_at = time.monotonic()
    await client.set(key, b"another-holder", px=60_000)  # it ran out and another worker took it
    assert await task is False
    assert time.monotonic() - taken_at < 1.5  # at the next keep-alive, not after the slot
    assert counter(metrics.LEASE_LOST, "submit") == lost + 1
    assert await client.get(key) == b"another-holder"  # the other holder's lease is left alone
    assert await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = 'op-ll'") == "accepted"
    assert (await simulator.get("/_sim/operations/op-ll"))["posts"] == 0


async def test_a_submission_whose_lease_was_lost_while_waiting_takes_it_again_then_posts_once(
    runtimes: Callable[..., Awaitable[Runtime]], pool: asyncpg.Pool, simulator: Simulator
) -> None:
    rt = await runtimes(remote_post_rate_per_s=0.5, lease_busy_retry_s=0.1)
    key = await waiting_for_a_post_slot(rt, "op-lt")
    client = rt.leases.client
    lost, busy = counter(metrics.LEASE_LOST, "submit"), counter(metrics.LEASE_BUSY, "submit")
    task = asyncio.create_task(Dispatcher(rt).handle(submission("op-lt")))
    await wait_for(lambda: key_exists(client, key), 5, "the submit lease taken")
    await client.set(key, b"another-holder", px=60_000)

    async def waits_for_the_other_holder() -> bool:
        return counter(metrics.LEASE_LOST, "submit") == lost + 1 and counter(metrics.LEASE_BUSY, "submit") >= busy + 2

    await wait_for(waits_for_the_other_holder, 5, "the lease found lost, then held by the other holder")
    assert await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = 'op-lt'") == "accepted"
    assert (await simulator.get("/_sim/operations/op-lt"))["posts"] == 0
    await client.delete(key)  # the other holder is done: the event takes the lease, waits for a slot, POSTs
    await asyncio.wait_for(task, 10)
    record = await simulator.get("/_sim/operations/op-lt")
    assert (record["posts"], len(record["jobs"])) == (1, 1)
    assert await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = 'op-lt'") == "submitted"
    assert not await client.exists(key)  # released after the POST


async def test_a_submission_cancelled_while_waiting_for_a_post_slot_releases_its_lease(
    runtimes: Callable[..., Awaitable[Runtime]], pool: asyncpg.Pool, simulator: Simulator
) -> None:
    rt = await runtimes(remote_post_rate_per_s=0.5)
    key = await waiting_for_a_post_slot(rt, "op-lc")
    client = rt.leases.client
    task = asyncio.create_task(Dispatcher(rt).handle(submission("op-lc")))
    await wait_for(lambda: key_exists(client, key), 5, "the submit lease taken")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not await client.exists(key)  # released at once, not left to run out (another worker may go on)
    assert await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = 'op-lc'") == "accepted"
    assert (await simulator.get("/_sim/operations/op-lc"))["posts"] == 0


async def test_a_budget_outage_inside_the_claim_is_waited_out_not_spun(
    runtimes: Callable[..., Awaitable[Runtime]],
    pool: asyncpg.Pool,
    simulator: Simulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A POST retried after a 429 waits for its slot inside the claim: Redis not answering the budget there is
    asked again after doubling waits, not in a busy loop, until the retry deadline; then ``rejected``, not sent
    again."""
    rt = await runtimes(submit_retry_deadline_s=3.0)
    working = rt.budget
    await simulator.configure(fault_429=1.0, retry_after_s=1)
    caplog.set_level(logging.INFO, logger="streams.worker.stages.dispatcher")
    task = asyncio.create_task(Dispatcher(rt).handle(submission("op-sp")))
    pause_key = budget_key(rt.settings, "POST", "pause")
    await wait_for(lambda: key_exists(rt.leases.client, pause_key), 5, "the 429's pause in Redis")
    dead = make_redis(f"redis://127.0.0.1:{free_port()}/0", 0.5)
    rt.budget = RateBudget(dead, rt.settings)  # from the retry on, the budget's Redis refuses
    try:
        await asyncio.wait_for(task, 10)
    finally:
        rt.budget = working
        await dead.aclose()
        await simulator.configure(fault_429=0.0)
    asks = [r for r in caplog.records if r.getMessage().startswith("POST slot wait interrupted")]
    # About 2 s left after the Retry-After: asked at 0, 0.1, 0.3, 0.7 and 1.5 s, then the deadline (a loop
    # without waits asks hundreds of times).
    assert 3 <= len(asks) <= 8, len(asks)
    row = await pool.fetchrow("SELECT state::text AS state, reason_code FROM operations WHERE operation_id = 'op-sp'")
    assert row is not None and (row["state"], row["reason_code"]) == ("rejected", "not_sent")
    assert (await simulator.get("/_sim/operations/op-sp"))["post_statuses"] == [429]
