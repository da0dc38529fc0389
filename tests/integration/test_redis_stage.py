"""The worker's coalescing Redis stage against a real Redis: the lease commands and rate budget slots of many
tasks in few round trips (counted by Redis itself), each caller with its own answer; a flushed script cache;
Redis refusing or silent; releases whose callers are cancelled.

Each test runs a PRIVATE ``redis-server`` (:class:`streams_harness.redis_server.PrivateRedis`) on a free port:
its counters (``INFO stats`` ``total_reads_processed``: one read event per request a client sends, however many
commands it pipelines; ``INFO commandstats``) hold this test's commands only, and flushing its script cache or
stopping it touches no one else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import redis.asyncio as aioredis

from streams.config import Settings, budget_key
from streams.coordination.lease import RELEASE_LUA, RENEW_LUA, Lease, LeaseManager, make_redis
from streams.coordination.ratebudget import BUDGET_LUA, BudgetKind, Grant, RateBudget
from streams.coordination.redisstage import REDIS_MAX_IN_FLIGHT, RedisStage
from streams.errors import CoordinationUnavailableError, LeaseLostError
from streams_harness.redis_server import PrivateRedis
from tests.support import ReplyCutter, wait_for

pytestmark = pytest.mark.integration

T = TypeVar("T")

TTL_MS = 10_000

#: POSTs paced at 10/s with a burst of 2: the k-th slot taken at once (0-based) is granted max(0, k - 1) x 0.1 s on.
BUDGET_SETTINGS = Settings().replace(remote_post_rate_per_s=10.0, remote_post_burst=2)


@dataclass
class Wiring:
    """What a worker's runtime wires on its Redis client: one stage, the leases and the budget through it."""

    client: aioredis.Redis
    stage: RedisStage
    leases: LeaseManager
    budget: RateBudget


@pytest.fixture
async def private_redis(tmp_path: Path) -> AsyncIterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    await server.start()
    yield server
    server.stop()


@pytest.fixture
async def probe(private_redis: PrivateRedis) -> AsyncIterator[aioredis.Redis]:
    """The test's own client on one connection (its readings cost the same read events each time)."""
    client = aioredis.Redis.from_url(private_redis.url, single_connection_client=True)
    yield client
    await client.aclose()


@pytest.fixture
async def wire(private_redis: PrivateRedis) -> AsyncIterator[Callable[..., Wiring]]:
    clients: list[aioredis.Redis] = []

    def make(*, socket_timeout_s: float = 1.0, max_in_flight: int = REDIS_MAX_IN_FLIGHT) -> Wiring:
        client = make_redis(private_redis.url, socket_timeout_s, max_connections=8, pool_timeout_s=1.0)
        clients.append(client)
        stage = RedisStage(client, max_in_flight=max_in_flight)
        return Wiring(
            client, stage, LeaseManager(client, TTL_MS, stage=stage), RateBudget(client, BUDGET_SETTINGS, stage=stage)
        )

    yield make
    for client in clients:
        await client.aclose()


class RoundTrips:
    """Read events Redis counted (``total_reads_processed``) during a block, less the probe's own reading."""

    def __init__(self, probe: aioredis.Redis) -> None:
        self.probe = probe
        self.reading_cost = 0
        self.used = -1

    async def _reads(self) -> int:
        return int((await self.probe.info("stats"))["total_reads_processed"])

    async def calibrate(self) -> None:
        first = await self._reads()
        self.reading_cost = await self._reads() - first

    async def measure(self, block: Awaitable[T]) -> T:
        before = await self._reads()
        results = await block
        self.used = await self._reads() - before - self.reading_cost
        return results


async def command_calls(probe: aioredis.Redis) -> dict[str, int]:
    """``INFO commandstats`` calls by command (``evalsha``, ``eval``, ``script|load``, ``set``...)."""
    stats = await probe.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def increase(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


async def test_concurrent_lease_commands_and_budget_slots_share_round_trips_each_with_its_own_answer(
    wire: Callable[..., Wiring], probe: aioredis.Redis
) -> None:
    """40 acquisitions at once (10 keys held by another owner), then 30 renewals (5 leases taken over meanwhile)
    together with 10 budget slots, then 30 releases: each group costs a few round trips instead of one per
    command, and every caller gets its own answer."""
    w = wire()
    trips = RoundTrips(probe)
    await trips.calibrate()
    keys = [f"stage:{i}" for i in range(40)]
    for key in keys[:10]:
        await probe.set(key, "other-owner", px=TTL_MS)
    for script in (RENEW_LUA, RELEASE_LUA, BUDGET_LUA):  # as a running worker finds them: cached
        await probe.script_load(script)
    warm = await w.leases.acquire("stage:warm-up")  # the pooled connection's handshake, not counted below
    assert warm is not None and await warm.release() is True

    results = await trips.measure(asyncio.gather(*(w.leases.acquire(k) for k in keys)))
    assert trips.used <= 3, f"40 acquisitions took {trips.used} round trips"
    assert [r is None for r in results] == [i < 10 for i in range(40)]
    leases = [r for r in results if isinstance(r, Lease)]
    assert len({lease.token for lease in leases}) == 30  # an owner token of its own per lease
    for lease in leases:
        assert await probe.get(lease.key) == lease.token.encode()
    for key in keys[:10]:
        assert await probe.get(key) == b"other-owner"

    lost, kept = leases[:5], leases[5:]
    for lease in lost:
        await probe.set(lease.key, "someone-else", px=TTL_MS)
    for lease in kept:
        await probe.pexpire(lease.key, 3000)  # so that the renewal shows
    calls_before = await command_calls(probe)
    block = asyncio.gather(
        *(lease.renew() for lease in leases),
        *(w.budget.take(BudgetKind.POST) for _ in range(10)),
        return_exceptions=True,
    )
    answers = await trips.measure(block)
    assert trips.used <= 3, f"30 renewals and 10 budget slots took {trips.used} round trips"
    assert [type(a) for a in answers[:5]] == [LeaseLostError] * 5
    assert {a.key for a in answers[:5] if isinstance(a, LeaseLostError)} == {lease.key for lease in lost}
    assert answers[5:30] == [None] * 25
    grants = [a for a in answers[30:] if isinstance(a, Grant)]
    assert [g.granted for g in grants] == [1] * 10
    assert [g.wait_s for g in grants] == pytest.approx([max(0, k - 1) * 0.1 for k in range(10)], abs=0.01)
    for lease in lost:
        assert await probe.get(lease.key) == b"someone-else"
    for lease in kept:
        assert await probe.pttl(lease.key) > 9000
    calls = increase(await command_calls(probe), calls_before)
    assert calls["evalsha"] == 40  # each command ran once (probe's INFO aside)

    released = await trips.measure(asyncio.gather(*(lease.release() for lease in leases)))
    assert trips.used <= 3, f"30 releases took {trips.used} round trips"
    assert released == [False] * 5 + [True] * 25
    for lease in lost:
        assert await probe.get(lease.key) == b"someone-else"  # a newer owner's key is never deleted
    for lease in kept:
        assert await probe.exists(lease.key) == 0


async def test_a_flushed_script_cache_is_reloaded_and_each_command_runs_once(
    wire: Callable[..., Wiring], probe: aioredis.Redis
) -> None:
    """SCRIPT FLUSH between two batches: every script command of the next batch answers NOSCRIPT (it did not
    run), is sent again once, and answers truly: renewed, lost (really taken over), released, budget slots
    counted once. With only one script flushed, only its commands are sent again."""
    w = wire()
    a, b, c, d = [await w.leases.acquire(f"flush:{n}") for n in "abcd"]
    assert a is not None and b is not None and c is not None and d is not None
    # every script cached; 9 POST slots taken, so the budget's TAT stands 0.9 s ahead of now (10/s, burst 2)
    await asyncio.gather(a.renew(), d.renew(), *(w.budget.take(BudgetKind.POST) for _ in range(9)))
    await probe.script_flush()
    await probe.set(b.key, "someone-else", px=TTL_MS)
    await probe.pexpire(a.key, 3000)
    before = await command_calls(probe)
    answers = await asyncio.gather(
        a.renew(),
        b.renew(),
        c.release(),
        w.budget.take(BudgetKind.POST),
        w.budget.take(BudgetKind.POST),
        return_exceptions=True,
    )
    assert answers[0] is None and await probe.pttl(a.key) > 9000
    assert isinstance(answers[1], LeaseLostError) and await probe.get(b.key) == b"someone-else"
    assert answers[2] is True and await probe.exists(c.key) == 0
    first, second = answers[3], answers[4]
    assert isinstance(first, Grant) and isinstance(second, Grant) and first.granted == second.granted == 1
    # each slot taken once: one interval (100 ms) apart, and the TAT one interval past the last slot plus tau
    assert second.at_us - first.at_us == 100_000
    assert int(await probe.get(budget_key(BUDGET_SETTINGS, "POST", "tat")) or 0) == second.at_us + 200_000
    calls = increase(await command_calls(probe), before)
    assert calls.get("eval") == 5 and calls.get("script|load") == 3  # the 5 resent, 3 scripts loaded

    # Only the release script flushed (the renewal's loaded again by hand): only the release is sent again.
    await probe.script_flush()
    await probe.script_load(RENEW_LUA)
    before = await command_calls(probe)
    renewed, released = await asyncio.gather(a.renew(), d.release())
    assert renewed is None and released is True and await probe.exists(d.key) == 0
    calls = increase(await command_calls(probe), before)
    assert calls.get("eval") == 1 and calls.get("script|load") == 1
    assert await probe.script_exists(w.leases._release.sha) == [True]
    assert w.leases._release.sha == (await probe.script_load(RELEASE_LUA))

    before = await command_calls(probe)  # the next batches find the scripts by SHA again
    await a.renew()
    assert "eval" not in increase(await command_calls(probe), before)
    assert await a.release() is True


@pytest.mark.parametrize("mode", ["refused", "silent"])
async def test_redis_unavailable_fails_every_caller_of_the_batch(
    mode: str, wire: Callable[..., Wiring], private_redis: PrivateRedis
) -> None:
    """Redis stopped (refused) or stopped answering (SIGSTOP: connections stay open, nothing comes back): every
    caller of the batch gets a CoordinationUnavailableError of its own naming its lease or budget, within about
    one socket timeout; releases are logged, not raised, and the keys keep their expiry."""
    w = wire(socket_timeout_s=0.5)
    held = [await w.leases.acquire(f"down:{i}") for i in range(4)]
    leases = [lease for lease in held if lease is not None]
    assert len(leases) == 4
    if mode == "refused":
        private_redis.stop()
    else:
        private_redis.pause()
    started = time.monotonic()
    answers = await asyncio.gather(
        *(w.leases.acquire(f"down:new:{i}") for i in range(4)),
        *(lease.renew() for lease in leases),
        *(w.budget.take(BudgetKind.POST) for _ in range(4)),
        return_exceptions=True,
    )
    elapsed = time.monotonic() - started
    assert all(isinstance(a, CoordinationUnavailableError) for a in answers), answers
    assert len({id(a) for a in answers}) == 12  # each caller its own exception
    assert "lease 'down:new:0' (acquire)" in str(answers[0])
    assert "lease 'down:0'" in str(answers[4])
    assert "the POST rate budget of account 'default'" in str(answers[8])
    assert elapsed < 3.0, f"the batch took {elapsed:.2f} s to be reported unavailable"
    assert await asyncio.gather(*(lease.release() for lease in leases)) == [False] * 4
    if mode == "silent":
        private_redis.resume()
        probe = aioredis.Redis.from_url(private_redis.url)
        for lease in leases:  # released in vain while silent: each key keeps its expiry
            assert 0 < await probe.pttl(lease.key) <= TTL_MS
        await probe.aclose()


async def test_releases_cancelled_on_the_wire_or_in_the_queue_still_complete(
    wire: Callable[..., Wiring], private_redis: PrivateRedis, probe: aioredis.Redis
) -> None:
    """Releases whose callers are cancelled while their pipeline is on the wire (Redis paused) and while they
    wait in the queue behind it: each caller sees CancelledError, and every key is still deleted (well before
    its TTL) once Redis answers again."""
    w = wire(socket_timeout_s=5.0, max_in_flight=1)
    held = [await w.leases.acquire(f"cancel:{i}") for i in range(20)]
    leases = [lease for lease in held if lease is not None]
    assert len(leases) == 20
    private_redis.pause()
    try:
        on_wire = [asyncio.ensure_future(lease.release()) for lease in leases[:10]]

        async def first_on_wire() -> bool:
            return w.stage.in_flight == 1 and w.stage.queued == 0

        await wait_for(first_on_wire, 5, "the first releases' pipeline on the wire")
        queued = [asyncio.ensure_future(lease.release()) for lease in leases[10:]]

        async def rest_queued() -> bool:
            return w.stage.queued == 10

        await wait_for(rest_queued, 5, "the other releases queued behind it")
        for task in on_wire + queued:
            task.cancel()
        outcomes = await asyncio.gather(*on_wire, *queued, return_exceptions=True)
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    finally:
        private_redis.resume()
    started = time.monotonic()

    async def all_released() -> bool:
        return await probe.exists(*(lease.key for lease in leases)) == 0

    await wait_for(all_released, 5, "every cancelled release to complete")
    assert time.monotonic() - started < TTL_MS / 2000  # deleted by the releases, not expired
    await w.stage.drain()


@pytest.fixture
async def cutter(private_redis: PrivateRedis) -> AsyncIterator[ReplyCutter]:
    relay = ReplyCutter(private_redis.port)
    await relay.start()
    yield relay
    await relay.stop()


async def test_a_pipeline_whose_replies_are_lost_after_it_ran_is_not_run_twice(
    cutter: ReplyCutter, probe: aioredis.Redis
) -> None:
    """The connection drops after Redis ran a batch and before its replies were read (a network cut, Redis
    killed right after answering). redis-py's retry (:func:`streams.coordination.lease.make_redis`) sends the whole
    pipeline
    again on a fresh connection. Safe for renewals and releases; not for the other commands:

    * ``SET NX`` finds the key set by its own first run: the acquisition answers "busy" while the key holds its
      own, now unknown, owner token (the job is kept from every worker, this one too, for a whole TTL);
    * a rate budget refund gives the units back twice, so the next grants may exceed the pace (the window bound).
    """
    client = make_redis(f"redis://127.0.0.1:{cutter.port}/0", 1.0, max_connections=8, pool_timeout_s=1.0)
    stage = RedisStage(client)
    leases = LeaseManager(client, TTL_MS, stage=stage)
    budget = RateBudget(client, BUDGET_SETTINGS, stage=stage)
    try:
        warm = await leases.acquire("cut:warm-up")  # a pooled connection ready, scripts aside
        assert warm is not None and await warm.release()

        cutter.marker = b"cut:lease"
        lease = await leases.acquire("cut:lease")
        assert cutter.cut == 1
        held_by = await probe.get("cut:lease")
        assert held_by is not None and 0 < await probe.pttl("cut:lease") <= TTL_MS  # never without expiry
        assert lease is not None and held_by == lease.token.encode(), "acquired, yet reported busy"

        tat_key = budget_key(BUDGET_SETTINGS, "POST", "tat")
        assert (await budget.take(BudgetKind.POST, count=5)).granted == 5  # the TAT: now + 5 x 100 ms
        before = int(await probe.get(tat_key) or 0)
        cutter.marker = b"refund"
        await budget.refund(BudgetKind.POST, 2)
        assert cutter.cut == 2
        after = int(await probe.get(tat_key) or 0)
        assert before - after == 2 * 100_000, f"refunded {(before - after) / 100_000:.0f} units for 2"
    finally:
        await stage.drain()
        await client.aclose()


async def test_lease_callers_cancelled_at_every_step_of_a_batch_leave_no_key_without_expiry(
    wire: Callable[..., Wiring], private_redis: PrivateRedis, probe: aioredis.Redis
) -> None:
    """Acquisitions, renewals and releases (as a rebalance cancels agents) cancelled while queued or on the wire,
    Redis silent meanwhile (SIGSTOP) and answering again: no caller hangs, the callers not cancelled each get an
    answer, and every lease key left behind still has its expiry (PTTL in (0, TTL])."""
    w = wire(socket_timeout_s=3.0, max_in_flight=1)
    held = [await w.leases.acquire(f"storm:held:{i}") for i in range(30)]
    leases = [lease for lease in held if lease is not None]
    assert len(leases) == 30
    private_redis.pause()
    try:
        calls: list[asyncio.Future[object]] = []
        for i in range(30):
            calls.append(asyncio.ensure_future(w.leases.acquire(f"storm:new:{i}")))
            calls.append(asyncio.ensure_future(leases[i].renew() if i % 2 else leases[i].release()))

        async def some_on_the_wire() -> bool:
            return w.stage.in_flight == 1

        await wait_for(some_on_the_wire, 5, "a batch on the wire")
        for k, call in enumerate(calls):
            if k % 3 == 0:  # on the wire (the first batch) or queued behind it
                call.cancel()
    finally:
        private_redis.resume()
    outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=15)
    for k, outcome in enumerate(outcomes):
        if k % 3 != 0:
            assert not isinstance(outcome, BaseException), (k, outcome)
    await w.stage.drain()
    keys = [key async for key in probe.scan_iter("storm:*")]
    assert keys, "some leases are left (the held ones renewed, acquisitions whose callers went away)"
    for key in keys:
        assert 0 < await probe.pttl(key) <= TTL_MS, key


async def test_an_acquisition_cancelled_on_the_wire_does_not_keep_the_job_from_everyone_for_a_ttl(
    wire: Callable[..., Wiring], private_redis: PrivateRedis, probe: aioredis.Redis
) -> None:
    """An agent cancelled (a rebalance) while its ``SET NX`` is on the wire: the command runs all the same, and
    its owner token is known to no one. The key is released once its answer comes, so the next owner of the
    partition can take the lease at once instead of waiting a whole TTL."""
    w = wire(socket_timeout_s=5.0, max_in_flight=1)
    warm = await w.leases.acquire("orphan:warm-up")
    assert warm is not None and await warm.release()
    private_redis.pause()
    try:
        acquiring = asyncio.ensure_future(w.leases.acquire("orphan:lease"))

        async def on_the_wire() -> bool:
            return w.stage.in_flight == 1

        await wait_for(on_the_wire, 5, "the acquisition on the wire")
        acquiring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await acquiring
    finally:
        private_redis.resume()
    started = time.monotonic()

    async def free_again() -> bool:
        return await probe.exists("orphan:lease") == 0

    await wait_for(free_again, 5, "the cancelled acquisition's key released")
    assert time.monotonic() - started < TTL_MS / 2000
    other = LeaseManager(w.client, TTL_MS, stage=w.stage)
    assert await other.acquire("orphan:lease") is not None
    await w.stage.drain()
