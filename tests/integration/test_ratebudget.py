"""The rate budget's Lua script against the real Redis: rate, burst, kinds apart, the 429 pause, giving back,
many tasks of several "workers" (clients) at once, and Redis unavailable."""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from streams import metrics
from streams.config import Settings, budget_key
from streams.coordination.lease import make_redis
from streams.coordination.ratebudget import BudgetKind, Pace, RateBudget
from streams.errors import CoordinationUnavailableError, LeaseLostError, RateBudgetDeadlineError
from streams_harness.fleet import free_port
from tests.support import key_exists, wait_for

pytestmark = pytest.mark.integration

#: Slack for the Redis round trips between two takes of one test on a loaded machine (s).
RTT_S = 0.05


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    c = make_redis(settings.redis_url.get_secret_value(), settings.redis_socket_timeout_s)
    yield c
    await c.aclose()


def budget(client: aioredis.Redis, settings: Settings, **rates: Any) -> RateBudget:
    return RateBudget(client, settings.replace(**rates))


async def test_grants_follow_the_rate(client: aioredis.Redis, settings: Settings) -> None:
    b = budget(client, settings, remote_post_rate_per_s=20.0, remote_post_burst=1)
    started = time.monotonic()
    grants = [await b.take(BudgetKind.POST) for _ in range(25)]
    took_s = time.monotonic() - started
    first = grants[0]
    assert (first.granted, first.wait_s) == (1, 0.0)
    # Unit k goes exactly k * 50 ms after the first (Redis clock); only those within the 1 s horizon of their
    # take are granted: k <= 20 at the first take, one more for every 50 ms the takes lasted (a loaded machine's
    # takes can last longer than 50 ms, so a grant may follow a refusal).
    granted = [g for g in grants if g.granted]
    assert [g.at_us - first.at_us for g in granted] == [k * 50_000 for k in range(len(granted))]
    assert 20 <= len(granted) <= 21 + int(took_s / 0.05), took_s
    assert all(not g.paused for g in grants)
    so_far = 0
    for grant in grants:  # a refused take is told when the next unit comes within the horizon
        if grant.granted:
            so_far += 1
        else:
            assert grant.at_us == first.at_us + so_far * 50_000 - 1_000_000


async def test_burst_then_pace_and_the_burst_comes_back_when_idle(client: aioredis.Redis, settings: Settings) -> None:
    b = budget(client, settings, remote_get_rate_per_s=5.0, remote_get_burst=4)
    first = [await b.take(BudgetKind.GET) for _ in range(6)]
    assert [g.wait_s for g in first[:4]] == [0.0] * 4  # the burst at once
    assert first[4].at_us - first[0].at_us == 200_000  # then the pace: 200 ms apart
    assert first[5].at_us - first[0].at_us == 400_000
    tat_key = budget_key(b.settings, "GET", "tat")
    ttl_ms = await client.pttl(tat_key)
    assert 0 < ttl_ms <= 1201  # the state lives only until the budget is full again (6 units * 200 ms)

    async def idle() -> bool:
        return bool(await client.exists(tat_key) == 0)

    await wait_for(idle, 3, "the budget's state to expire")
    assert [(await b.take(BudgetKind.GET)).wait_s for _ in range(4)] == [0.0] * 4


async def test_batch_grant_within_the_horizon_and_giving_back(client: aioredis.Redis, settings: Settings) -> None:
    b = budget(client, settings, remote_get_rate_per_s=10.0, remote_get_burst=1)
    grant = await b.take(BudgetKind.CLAIMS, 50, horizon_s=0.5)
    assert (grant.granted, grant.wait_s) == (6, 0.0)  # units at 0, 100, ..., 500 ms
    assert (await b.take(BudgetKind.CLAIMS, 50, horizon_s=0.5)).granted <= 1
    await b.refund(BudgetKind.CLAIMS, 50)  # more than was taken: back to idle, never below
    again = await b.take(BudgetKind.CLAIMS, 50, horizon_s=0.5)
    assert (again.granted, again.wait_s) == (6, 0.0)


async def test_kinds_are_budgeted_apart(client: aioredis.Redis, settings: Settings) -> None:
    b = budget(
        client,
        settings,
        remote_post_rate_per_s=1.0,
        remote_get_rate_per_s=1.0,
    )
    assert (await b.take(BudgetKind.POST)).wait_s == 0.0
    assert (await b.take(BudgetKind.POST, horizon_s=0.0)).granted == 0  # the POST budget is spent for 1 s
    assert (await b.take(BudgetKind.GET)).wait_s == 0.0  # GETs are not
    assert (await b.take(BudgetKind.CLAIMS)).wait_s == 0.0  # nor the scheduler's claims (their own state)
    assert (await b.take(BudgetKind.GET, horizon_s=0.0)).granted == 0


async def test_a_429_pauses_its_kind_for_retry_after(client: aioredis.Redis, settings: Settings) -> None:
    b = budget(client, settings, remote_post_rate_per_s=10.0, remote_post_burst=3, remote_get_rate_per_s=10.0)
    assert await b.pause(BudgetKind.POST, 0.4) == pytest.approx(0.4)
    pause_key = budget_key(b.settings, "POST", "pause")
    assert 0 < await client.pttl(pause_key) <= 400  # stored with a PX expiry
    pause_end_us = (await b.check(BudgetKind.POST)).at_us
    assert await b.pause(BudgetKind.POST, 0.1) > 0.1  # a shorter one never shortens it
    assert abs((await b.check(BudgetKind.POST)).at_us - pause_end_us) <= 1_000  # (PTTL counts whole ms)
    refused = await b.take(BudgetKind.POST)
    assert (refused.granted, refused.paused) == (0, True) and abs(refused.at_us - pause_end_us) <= 1_000
    assert (await b.take(BudgetKind.GET)).wait_s == 0.0  # GETs go on
    assert (await b.take(BudgetKind.CLAIMS)).granted == 1  # claims are stopped only by a GET's pause

    slot = await b.wait_for_slot(BudgetKind.POST)
    assert slot.at_us >= pause_end_us - 1_000  # not before the pause ends
    after = await b.take(BudgetKind.POST)
    assert abs(after.at_us - (pause_end_us + 100_000)) <= 1_000  # the pace restarts at the end, without a burst

    await b.pause(BudgetKind.GET, 0.3)
    claims = await b.take(BudgetKind.CLAIMS, 10)
    assert (claims.granted, claims.paused) == (0, True)  # the scheduler claims no polls while GETs are paused


async def test_a_reservation_made_before_a_pause_waits_for_the_pause(
    client: aioredis.Redis, settings: Settings
) -> None:
    b = budget(client, settings, remote_post_rate_per_s=5.0)
    assert (await b.take(BudgetKind.POST)).wait_s == 0.0
    started = time.monotonic()
    waiter = asyncio.create_task(b.wait_for_slot(BudgetKind.POST))  # reserves the slot 200 ms ahead

    async def reserved() -> bool:
        tat = await client.get(budget_key(b.settings, "POST", "tat"))
        return tat is not None and (await client.pttl(budget_key(b.settings, "POST", "tat"))) > 250

    await wait_for(reserved, 2, "the waiter's reservation")
    await b.pause(BudgetKind.POST, 0.6)
    await waiter
    assert time.monotonic() - started >= 0.6 - 0.002  # the reservation at +200 ms did not go during the pause


async def test_an_unpaced_kind_still_honours_a_pause(client: aioredis.Redis, settings: Settings) -> None:
    b = budget(client, settings)  # rates 0: no pacing
    assert [(await b.take(BudgetKind.GET)).wait_s for _ in range(50)] == [0.0] * 50
    assert not await client.exists(budget_key(b.settings, "GET", "tat"))  # no state kept without a pace
    await b.pause(BudgetKind.GET, 0.3)
    assert (await b.take(BudgetKind.GET)).paused


async def test_wait_keeps_the_caller_alive_and_stops_when_it_is_lost(
    client: aioredis.Redis, settings: Settings
) -> None:
    b = budget(client, settings, remote_post_rate_per_s=2.0)
    assert (await b.take(BudgetKind.POST)).wait_s == 0.0
    renewals: list[float] = []

    async def renew() -> None:
        renewals.append(time.monotonic())

    waits_before = metrics.BUDGET_WAITS.labels("POST")._value.get()
    waited_s = (await b.wait_for_slot(BudgetKind.POST, keep_alive=renew, keep_alive_every_s=0.1)).waited_s
    assert 0.5 - RTT_S <= waited_s < 0.5 + 0.2
    assert len(renewals) >= 3  # about every 0.1 s of the 0.5 s wait
    assert metrics.BUDGET_WAITS.labels("POST")._value.get() == waits_before + 1

    async def lost() -> None:
        raise LeaseLostError("k")

    with pytest.raises(LeaseLostError):
        await b.wait_for_slot(BudgetKind.POST, keep_alive=lost, keep_alive_every_s=0.1)


async def test_a_wait_of_many_short_sleeps_keeps_the_caller_alive(client: aioredis.Redis, settings: Settings) -> None:
    b = budget(client, settings)
    renewals: list[float] = []

    async def renew() -> None:
        renewals.append(time.monotonic())

    async def pause_again_and_again() -> None:  # pauses of 0.15 s, each set before the last ends
        for _ in range(8):
            await b.pause(BudgetKind.POST, 0.15)
            await asyncio.sleep(0.1)

    pauser = asyncio.create_task(pause_again_and_again())
    await wait_for(lambda: key_exists(client, budget_key(b.settings, "POST", "pause")), 2, "the first pause")
    started = time.monotonic()
    await b.wait_for_slot(BudgetKind.POST, keep_alive=renew, keep_alive_every_s=0.3)
    await pauser
    waited_s = time.monotonic() - started
    assert waited_s >= 0.7  # through the 8 pauses
    assert len(renewals) >= int(waited_s / 0.3) - 1  # every 0.3 s of the whole wait, though no sleep was that long


async def test_no_slot_before_the_deadline(client: aioredis.Redis, settings: Settings) -> None:
    b = budget(client, settings, remote_post_rate_per_s=1.0)
    assert (await b.take(BudgetKind.POST)).wait_s == 0.0
    started = time.monotonic()
    with pytest.raises(RateBudgetDeadlineError, match="POST slot of the rate budget of account 'default'"):
        await b.wait_for_slot(BudgetKind.POST, deadline=time.monotonic() + 0.3)
    assert time.monotonic() - started < 0.1  # known at once, not after waiting


async def test_redis_unavailable_means_no_slot() -> None:
    dead = make_redis(f"redis://127.0.0.1:{free_port()}/0", 0.5)
    b = RateBudget(dead, Settings().replace(remote_post_rate_per_s=5.0))
    try:
        with pytest.raises(CoordinationUnavailableError, match="Redis unavailable for the POST rate budget"):
            await b.wait_for_slot(BudgetKind.POST)
        with pytest.raises(CoordinationUnavailableError):
            await b.take(BudgetKind.GET)  # even unpaced: the pause cannot be read
    finally:
        await dead.aclose()


def most_in_window(times: list[float] | list[int], window: float) -> int:
    """The largest number of ``times`` (sorted) in any closed window of length ``window`` (the same unit)."""
    return max(bisect.bisect_right(times, t + window) - i for i, t in enumerate(times))


async def test_many_tasks_of_several_workers_never_exceed_the_budget(settings: Settings) -> None:
    rate, burst, run_s = 40.0, 4, 3.0
    clients = [make_redis(settings.redis_url.get_secret_value(), 2.0) for _ in range(3)]  # three "workers"
    budgets = [budget(c, settings, remote_get_rate_per_s=rate, remote_get_burst=burst) for c in clients]
    slots: list[int] = []  # send times granted, on the Redis clock (microseconds)
    sent: list[float] = []  # when the calls went: the tasks' wake-ups (s)
    started = time.monotonic()

    async def caller(b: RateBudget) -> None:
        while time.monotonic() - started < run_s:
            slot = await b.wait_for_slot(BudgetKind.GET)
            sent.append(time.monotonic())
            slots.append(slot.at_us)

    try:
        await asyncio.gather(*(caller(b) for b in budgets for _ in range(40)))  # 120 tasks
    finally:
        for c in clients:
            await c.aclose()
    slots.sort()
    sent.sort()
    pace = Pace.from_rate(rate, burst)
    # The grants: never more than floor(W * rate) + burst in any window W, exactly.
    for window_us in (0, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_000_000, slots[-1] - slots[0]):
        bound = pace.window_bound(window_us / 1_000_000)
        most = most_in_window(slots, window_us)
        assert bound is not None and most <= bound, (window_us, most, bound)
    # ... and the budget is used, not starved: about rate * time after the first burst.
    assert len(slots) >= 0.9 * rate * (slots[-1] - slots[0]) / 1_000_000
    # The calls go when their tasks wake, never before their slots (the same machine's clocks); a late wake-up
    # (a loaded machine) brings a call closer to the next one, so only the whole run's rate is compared.
    assert len(sent) <= (pace.window_bound(sent[-1] - sent[0] + 0.2) or 0)


async def test_a_pause_one_worker_shares_is_capped_and_says_who_set_it(
    client: aioredis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 429 whose Retry-After says 120 s (or a date misread through a skewed clock): the account's shared pause
    # is at most remote_shared_pause_cap_s, and its record names the worker that set it, set by a worker whose
    # wall clock is 120 s ahead.
    capped = RateBudget(client, settings.replace(remote_shared_pause_cap_s=2.0), owner="worker-a")
    before_s, before_us = await client.time()
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 120.0)
    await capped.note_rate_limited(BudgetKind.GET, 120.0)
    monkeypatch.setattr(time, "time", real_time)
    after_s, after_us = await client.time()
    pause_ms = await client.pttl(budget_key(settings, "GET", "pause"))
    assert 0 < pause_ms <= 2000
    record = await capped.pause_record(BudgetKind.GET)
    assert record is not None and (record["by"], record["pause_s"]) == ("worker-a", 2.0)
    # When it was set is on the Redis clock (TIME), the one every worker's budget runs on, not worker-a's own.
    assert (before_s * 1000 + before_us // 1000) <= record["set_at_ms"] <= (after_s * 1000 + after_us // 1000)
    other = RateBudget(client, settings, owner="worker-b")
    grant = await other.check(BudgetKind.GET)  # every worker sees the same, capped pause
    assert grant.granted == 0 and 0 < grant.wait_s <= 2.0
    assert await other.pause_record(BudgetKind.POST) is None
