"""At most one GET in flight per job, even when a GET outlives its lease or its client's read timeout.

Real sockets throughout: the simulator on a loopback port, a trickling HTTP proxy in front of it
(:mod:`tests.http_faults`), real Redis leases and the real ledger. Polls are claimed with the scheduler's own
query (visibility timeout included) and handed to two workers' observers without waiting, as the observe
agents of two worker processes would run them. The count of GETs in flight comes from the provider's side:
the proxy's (answers it is still delivering) and the simulator's own ``max_gets_in_flight``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import orjson
import pytest

from streams import metrics
from streams.config import Settings, lease_key
from streams.errors import RemoteNotSentError, RemoteUnknownOutcomeError
from streams.remote.client import RemoteClient
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.observer import Observer
from tests.http_faults import TricklingProxy
from tests.integration.test_observer import claim_poll, state_of, submitted_operation
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration

#: A provider request (JSON text) as a submission carries it.
REQUEST = '{"input": {"prompt": "a short prompt", "max_tokens": 1}}'

SendFn = Callable[[str, bytes, bytes], Awaitable[Any]]

#: One byte of a trickled answer every this many seconds: well within the 2 s read timeout of the tests.
BYTE_INTERVAL_S = 0.5


@pytest.fixture
async def proxy(simulator: Simulator) -> AsyncIterator[TricklingProxy]:
    p = TricklingProxy(simulator.port, BYTE_INTERVAL_S)
    await p.start()
    yield p
    await p.stop()


class Workers:
    """Two worker runtimes and a poll loop: every 50 ms the due polls are claimed with the scheduler's query and
    each is handed, in turn, to one worker's observer in a task of its own (not awaited)."""

    def __init__(self, runtimes: list[Runtime]) -> None:
        self.runtimes = runtimes
        self.observers = [Observer(rt) for rt in runtimes]
        self.tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        rt = self.runtimes[0]
        turn = 0
        while True:
            for p in await rt.ledger.claim_due_polls(100, rt.settings.visibility_timeout_s):
                value = {
                    "operation_id": p.operation_id,
                    "remote_job_id": p.remote_job_id,
                    "poll_claim_id": p.poll_claim_id,
                    "claimed_at_ms": int(time.time() * 1000),
                }
                message = RawMessage("generation.polls", 0, 0, p.operation_id.encode(), orjson.dumps(value))
                task = asyncio.create_task(self.observers[turn % len(self.observers)].handle(message))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                turn += 1
            await asyncio.sleep(0.05)

    def start(self) -> None:
        self._loop = asyncio.create_task(self._run())

    async def stop(self) -> None:
        pending = [t for t in (self._loop, *self.tasks) if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


@pytest.fixture
async def workers_factory(
    pool: asyncpg.Pool, kafka_send: SendFn
) -> AsyncIterator[Callable[[Settings], Awaitable[Workers]]]:
    made: list[Workers] = []

    async def make(settings: Settings) -> Workers:
        runtimes = [await Runtime.create(settings, kafka_send, worker=f"w{i}") for i in range(2)]
        workers = Workers(runtimes)
        made.append(workers)
        return workers

    yield make
    for workers in made:
        await workers.stop()
        for rt in workers.runtimes:
            await rt.close()


async def abandoned_gets(pool: asyncpg.Pool, op: str) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM remote_calls WHERE operation_id=$1 AND method='GET' AND outcome='abandoned'", op
        )
    )


async def test_trickled_answer_outliving_the_lease_never_overlaps_the_next_get(
    settings: Settings,
    pool: asyncpg.Pool,
    simulator: Simulator,
    proxy: TricklingProxy,
    workers_factory: Callable[[Settings], Awaitable[Workers]],
) -> None:
    """The first GET's answer arrives one byte every 0.5 s (each read well within the 2 s read timeout), so
    only the overall deadline ends it. Without one, the 2 s lease ran out, the 3 s visibility timeout brought the
    poll back and the second worker's GET joined the first (2 in flight at the proxy)."""
    settings = settings.replace(remote_base_url=proxy.url)
    assert settings.remote_call_deadline_s + settings.lease_margin_s < settings.lease_ttl_s < 3.0
    workers = await workers_factory(settings)
    job_id = await submitted_operation(workers.runtimes[0], "op-trickle")
    proxy.trickle_get(job_id)
    workers.start()

    async def succeeded() -> bool:
        return await state_of(pool, "op-trickle") == "succeeded"

    await wait_for(succeeded, 20, "the operation to succeed after the trickled GET")
    assert proxy.trickled == [job_id]
    assert proxy.max_in_flight[job_id] == 1
    job = (await simulator.get("/_sim/operations/op-trickle"))["jobs"][0]
    assert job["max_gets_in_flight"] == 1 and job["gets"] >= 2
    assert await abandoned_gets(pool, "op-trickle") == 1


async def test_provider_slower_than_the_read_timeout_never_gets_a_second_get_on_top(
    settings: Settings,
    pool: asyncpg.Pool,
    simulator: Simulator,
    workers_factory: Callable[[Settings], Awaitable[Workers]],
) -> None:
    """Every GET takes the simulator 1.5 s against a 0.5 s read timeout: each is abandoned by the client while
    the simulator still serves it. The next GET must not arrive on top of it (it did after ~0.5 s of backoff)."""
    settings = settings.replace(http_read_timeout_s=0.5)
    workers = await workers_factory(settings)
    await submitted_operation(workers.runtimes[0], "op-slow")
    await simulator.configure(get_latency_ms=1500)
    workers.start()

    async def three_gets() -> bool:
        return int((await simulator.get("/_sim/operations/op-slow"))["jobs"][0]["gets"]) >= 3

    await wait_for(three_gets, 20, "three GETs of the slow job")
    job = (await simulator.get("/_sim/operations/op-slow"))["jobs"][0]
    assert job["max_gets_in_flight"] == 1
    assert await abandoned_gets(pool, "op-slow") >= 2
    await simulator.configure(get_latency_ms=1)  # the provider recovers: the job is observed to the end

    async def succeeded() -> bool:
        return await state_of(pool, "op-slow") == "succeeded"

    await wait_for(succeeded, 20, "the operation to succeed once GETs are fast again")
    assert (await simulator.get("/_sim/operations/op-slow"))["jobs"][0]["max_gets_in_flight"] == 1


async def test_abandoned_get_leaves_the_lease_to_expire_and_polls_after_it(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """One GET abandoned on the read timeout: the lease is not released but renewed to a full TTL, and the next
    poll is due only once it has expired."""
    runtime.remote = RemoteClient.from_settings(runtime.settings.replace(http_read_timeout_s=0.3))
    await submitted_operation(runtime, "op-abandon")
    await simulator.configure(get_latency_ms=800)
    poll = await claim_poll(runtime, "op-abandon")
    before = metrics.ABANDONED_CALLS.labels("GET")._value.get()
    await Observer(runtime).handle(poll)
    key = lease_key(runtime.settings, "observe", "op-abandon")
    assert await runtime.leases.client.exists(key) == 1
    assert await runtime.leases.client.pttl(key) > runtime.settings.lease_ttl_ms - 500
    delay = await pool.fetchval(
        "SELECT extract(epoch FROM next_poll_at - now()) FROM operations WHERE operation_id='op-abandon'"
    )
    assert delay >= runtime.settings.lease_ttl_s - 0.2
    assert metrics.ABANDONED_CALLS.labels("GET")._value.get() == before + 1
    assert await abandoned_gets(pool, "op-abandon") == 1


async def test_lease_lost_during_a_long_get_cancels_it(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """The lease is renewed every third of its TTL during a GET; a renewal that finds another owner cancels the
    GET at once (no waiting for the answer), saves nothing and leaves the new owner's key alone."""
    await submitted_operation(runtime, "op-lost-mid")
    await simulator.configure(get_latency_ms=1300)
    poll = await claim_poll(runtime, "op-lost-mid")
    claim_id = orjson.loads(poll.value or b"")["poll_claim_id"]
    key = lease_key(runtime.settings, "observe", "op-lost-mid")
    lease = await runtime.leases.acquire(key, ttl_ms=600)  # renewed every 0.2 s during the GET
    assert lease is not None
    claim = await runtime.ledger.claim_for_observe("op-lost-mid", claim_id)
    assert claim is not None
    lost_before = metrics.LEASE_LOST.labels("observe")._value.get()
    started = time.monotonic()
    observing = asyncio.create_task(Observer(runtime)._observe("op-lost-mid", claim_id, claim, lease))

    async def get_started() -> bool:
        return int((await simulator.get("/_sim/operations/op-lost-mid"))["jobs"][0]["gets"]) == 1

    await wait_for(get_started, 5, "the GET to reach the simulator")
    await runtime.leases.client.set(key, "someone-else", px=5000)  # the lease changes hands mid-GET
    await asyncio.wait_for(observing, 5)
    elapsed = time.monotonic() - started
    assert elapsed < 1.0, f"the GET ran {elapsed:.2f} s: it was not cancelled when the renewal found it lost"
    assert metrics.LEASE_LOST.labels("observe")._value.get() == lost_before + 1
    assert await pool.fetchval("SELECT poll_count FROM operations WHERE operation_id='op-lost-mid'") == 0
    assert await runtime.leases.client.get(key) == b"someone-else"
    assert await abandoned_gets(pool, "op-lost-mid") == 1


async def test_post_with_a_trickled_answer_ends_at_the_deadline_as_unknown_outcome(
    settings: Settings, simulator: Simulator, proxy: TricklingProxy
) -> None:
    """A POST whose answer trickles in was sent: cut off by the deadline it is an unknown outcome (the job was
    created), never "not sent"."""
    proxy.trickle_posts = True
    client = RemoteClient.from_settings(settings.replace(remote_base_url=proxy.url))
    started = time.monotonic()
    try:
        async with asyncio.timeout(settings.remote_call_deadline_s + 3.0):
            with pytest.raises(RemoteUnknownOutcomeError, match="POST timed out after send"):
                await client.submit("op-post-trickle", REQUEST)
    finally:
        await client.aclose()
    assert time.monotonic() - started < settings.remote_call_deadline_s + 1.0
    assert len((await simulator.get("/_sim/operations/op-post-trickle"))["jobs"]) == 1


async def test_post_waiting_for_a_pooled_connection_past_the_deadline_was_not_sent(
    settings: Settings, simulator: Simulator, proxy: TricklingProxy
) -> None:
    """Both pooled connections are held by GETs whose answers trickle; a POST that waits for one until its
    deadline never sent a byte: "not sent" (retryable), and the simulator saw no POST."""
    settings = settings.replace(remote_base_url=proxy.url, dispatcher_concurrency=1, observer_concurrency=1)
    assert settings.http_max_connections == 2 and settings.http_pool_timeout_s > settings.remote_call_deadline_s
    client = RemoteClient.from_settings(settings)
    created = await client.submit("op-holder", REQUEST)
    proxy.trickle_get(created.job_id, times=2)
    holders = [asyncio.create_task(client.http.get(f"/v1/generations/{created.job_id}")) for _ in range(2)]
    try:

        async def pool_full() -> bool:
            return proxy.in_flight[created.job_id] == 2

        await wait_for(pool_full, 5, "both pooled connections to be busy")
        started = time.monotonic()
        with pytest.raises(RemoteNotSentError, match="POST not sent"):
            await client.submit("op-waiting", REQUEST)
        assert time.monotonic() - started < settings.remote_call_deadline_s + 1.0
    finally:
        for h in holders:
            h.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*holders, return_exceptions=True)
        await client.aclose()
    assert (await simulator.get("/_sim/operations/op-waiting"))["jobs"] == []
