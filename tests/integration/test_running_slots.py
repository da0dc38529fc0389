"""The concurrency budget against the real Redis, PostgreSQL and the simulator: slots per account and per model,
given back when the job is terminal, lapsing when a worker died holding one, kept while observed; a throttled answer
read like a 429; demand above the limit with zero throttled answers and every operation final."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
import redis.asyncio as aioredis

from streams.config import Settings
from streams.coordination.lease import make_redis
from streams.coordination.running import RunningSlots
from streams.worker.runtime import Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from tests.integration.test_dispatcher import request_text, submission
from tests.integration.test_observer import claim_poll, state_of
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    c = make_redis(settings.redis_url.get_secret_value(), settings.redis_socket_timeout_s)
    yield c
    await c.aclose()


def slots(client: aioredis.Redis, settings: Settings, **limits: float) -> RunningSlots:
    return RunningSlots(client, settings.replace(poll_backoff_cap_s=0.5, **limits))


async def test_limits_per_account_and_per_model(client: aioredis.Redis, settings: Settings) -> None:
    s = slots(client, settings, remote_account_max_running=3, remote_model_max_running=2)
    assert (await s.take("op-1", "m-a")).granted
    assert (await s.take("op-2", "m-a")).granted
    third = await s.take("op-3", "m-a")  # the model is full, the account is not
    assert (third.granted, third.account_in_use, third.model_in_use) == (False, 2, 2)
    assert (await s.take("op-1", "m-a")).granted  # held already: refreshed, still 2 in use
    assert (await s.take("op-3", "m-b")).granted
    fourth = await s.take("op-4", "m-b")  # the account is full
    assert (fourth.granted, fourth.account_in_use, fourth.model_in_use) == (False, 3, 1)
    await s.release("op-1")
    await s.release("op-1")  # given back once
    assert await s.in_use() == 2
    assert (await s.take("op-4", "m-a")).granted


async def test_a_slot_lost_with_its_worker_lapses_and_one_observed_does_not(
    client: aioredis.Redis, settings: Settings
) -> None:
    """A worker dies holding two slots (no release ever comes): the one whose job another worker keeps observing
    (refreshed by its GETs) stays; the other lapses after the TTL, and a waiting operation gets it."""
    s = slots(client, settings, remote_account_max_running=2, remote_running_slot_ttl_s=3.0)
    assert (await s.take("op-dead", "m")).granted and (await s.take("op-observed", "m")).granted
    taken_at = time.monotonic()
    assert not (await s.take("op-waiting", "m")).granted

    async def granted() -> bool:
        await s.refresh("op-observed")  # another worker's GET of the job still running
        return (await s.take("op-waiting", "m")).granted

    await wait_for(granted, 10, "the dead worker's slot to lapse")
    assert time.monotonic() - taken_at >= 2.9  # not before its TTL
    assert not (await s.take("op-other", "m")).granted  # the observed job kept its slot
    await s.release("op-observed")
    await s.release("op-waiting")
    assert await s.in_use() == 0 and await client.exists(*s.keys()) == 0  # nothing left behind


async def drive(runtime: Runtime, pool: asyncpg.Pool, ops: list[str]) -> None:
    """Dispatch ``ops`` at once and observe their jobs until every one is final."""
    observer = Observer(runtime)
    dispatches = [asyncio.ensure_future(Dispatcher(runtime).handle(submission(op, generated=4))) for op in ops]
    final = {"succeeded", "failed", "rejected", "uncertain", "stalled"}

    async def all_final() -> bool:
        for op in ops:
            state = await pool.fetchval("SELECT state::text FROM operations WHERE operation_id=$1", op)
            if state in ("submitted", "queued", "running"):
                await pool.execute("UPDATE operations SET next_poll_at = now() WHERE operation_id=$1", op)
                await observer.handle(await claim_poll(runtime, op))
        states = [await state_of(pool, op) for op in ops]
        return all(state in final for state in states)

    try:
        await wait_for(all_final, 60, "every operation to be final")
        await asyncio.gather(*dispatches)
    finally:
        for d in dispatches:
            d.cancel()


async def test_demand_above_the_limit_gets_no_throttled_answer_and_every_operation_ends(
    settings: Settings, pool: asyncpg.Pool, simulator: Simulator, kafka_send: object
) -> None:
    """Six submissions at once against a provider that runs two jobs at a time: with the account's limit at two,
    the provider never answers throttled, never runs more than two, and every operation succeeds."""
    await simulator.configure(concurrency_limit_per_account=2, compression=1.0, decode_ms_per_token=50.0, queue_ms=50.0)
    limited = settings.replace(remote_account_max_running=2, poll_backoff_cap_s=0.5, poll_backoff_base_s=0.05)
    runtime = await Runtime.create(limited, kafka_send, worker="test-worker")  # type: ignore[arg-type]
    try:
        ops = [f"op-demand-{i}" for i in range(6)]
        await drive(runtime, pool, ops)
        assert [await state_of(pool, op) for op in ops] == ["succeeded"] * 6
        summary = await simulator.get("/_sim/summary")
        assert summary["concurrency_throttled"] == 0 and summary["max_active_jobs"] == 2
        assert summary["jobs_created"] == 6
        assert await runtime.running.in_use() == 0  # every slot given back
    finally:
        await runtime.close()


async def test_a_throttled_answer_is_retried_like_a_429(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """Without a budget of its own the worker meets the provider's limit: the 400 THROTTLED answer is retried
    after its Retry-After (not ``rejected``), and the operation is submitted once a job ended."""
    await simulator.configure(concurrency_limit_per_account=1, compression=1.0, decode_ms_per_token=300.0, queue_ms=0.0)
    d = Dispatcher(runtime)
    await d.handle(submission("op-first", generated=4))  # ~1.2 s of work at the provider
    await d.handle(submission("op-throttled", generated=4))
    assert await state_of(pool, "op-throttled") == "submitted"
    calls = await pool.fetch(
        "SELECT outcome, status_code FROM remote_calls WHERE operation_id='op-throttled' AND method='POST' ORDER BY id"
    )
    outcomes = [(c["outcome"], c["status_code"]) for c in calls]
    assert outcomes[0] == ("rate_limited", 400) and outcomes[-1] == ("created", 201)
    assert (await simulator.get("/_sim/summary"))["concurrency_throttled"] == len(outcomes) - 1


def test_request_model_is_the_one_sent() -> None:
    from streams.worker.stages.dispatcher import request_model

    assert request_model(request_text(model="m-x"), "sim-1") == "m-x"
    assert request_model(request_text(), "sim-1") == "sim-1"
