"""Completion callbacks against PostgreSQL, Redis and the provider simulator (docs/callbacks.md): a signed callback
makes its job's poll due at once (fewer GETs than polling alone), a worker that does not observe the job takes
the callback all the same, refusals and replays are counted, and a lost callback still ends by fallback polling."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from streams.config import Settings, callback_secret_key
from streams.ledger import retention
from streams.remote.callbacks import signature
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.callbacks import CallbackReceiver
from streams.worker.stages.observer import Observer
from tests.integration.operators_support import backdate
from tests.integration.test_observer import state_of, submitted_operation
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration

SECRET = "whsec_" + base64.b64encode(b"callbacks integration test secret").decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"the secret before the rotation").decode()
#: The job's run time at the simulator (s, not compressed): far beyond the first poll.
JOB_S = 2.0
#: The scheduler's idle interval while callbacks wake it: without the wake-up a due poll would wait this long.
IDLE_S = 30.0


def refused(reason: str) -> float:
    return REGISTRY.get_sample_value("streams_callbacks_refused_total", {"reason": reason}) or 0.0


def received(result: str) -> float:
    return REGISTRY.get_sample_value("streams_callbacks_received_total", {"result": result}) or 0.0


async def job_gets(simulator: Simulator, job_id: str) -> int:
    jobs = (await simulator.get("/_sim/jobs"))["jobs"]
    return int(next(j["gets"] for j in jobs if j["job_id"] == job_id))


async def delivered(pool: asyncpg.Pool, op: str) -> int:
    return int(
        await pool.fetchval("SELECT count(*) FROM outbox WHERE operation_id=$1 AND topic_role='outputs_delivered'", op)
    )


@asynccontextmanager
async def callback_runtime(
    settings: Settings, send: Callable[[str, bytes, bytes], Awaitable[Any]], fallback_s: float, worker: str
) -> AsyncIterator[Runtime]:
    s = settings.replace(
        callbacks_enabled=True, callback_secrets=f"{OLD_SECRET} {SECRET}", callback_fallback_poll_interval_s=fallback_s
    )
    rt = await Runtime.create(s, send, worker=worker)
    try:
        yield rt
    finally:
        await rt.close()


@asynccontextmanager
async def receiver(rt: Runtime) -> AsyncIterator[str]:
    """The callback endpoint of ``rt`` on a loopback port; yields its URL."""
    app = web.Application()
    app.router.add_post(rt.settings.callback_path, CallbackReceiver(rt).handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}{rt.settings.callback_path}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def polling(rt: Runtime, idle_s: float) -> AsyncIterator[None]:
    """A worker's scheduler and observer without Kafka in between: due polls claimed and each observed at once,
    sleeping between rounds on the worker's own poll wake-up (:attr:`Runtime.wakeups` ``.polls``), ``idle_s`` at
    most."""
    observer = Observer(rt)

    async def tick() -> int:
        polls = await rt.ledger.claim_due_polls(100, rt.settings.visibility_timeout_s)
        for p in polls:
            value = {
                "operation_id": p.operation_id,
                "remote_job_id": p.remote_job_id,
                "poll_claim_id": p.poll_claim_id,
                "claimed_at_ms": p.claimed_at_ms,
            }
            await observer.handle(RawMessage("generation.polls", 0, 0, p.operation_id.encode(), orjson.dumps(value)))
        return len(polls)

    async def rounds() -> None:
        while True:
            if not await tick():
                await rt.wakeups.polls.wait(idle_s)

    task = asyncio.create_task(rounds())
    try:
        yield
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def long_jobs(simulator: Simulator, **callbacks: Any) -> None:
    """Jobs take :data:`JOB_S` (queued all along) and hint short polls (200 ms)."""
    await simulator.configure(
        compression=1.0,
        queue_ms=JOB_S * 1000,
        prefill_ms_per_token=0.0,
        decode_ms_per_token=0.0,
        poll_max_ms=200,
        multi_output_rate=0.0,
        **callbacks,
    )


async def test_a_callback_delivers_soon_with_fewer_gets_than_polling_alone(
    settings: Settings, runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, kafka_send: Any
) -> None:
    await long_jobs(simulator)
    # Without callbacks: the poll hints are followed until the job ends.
    baseline_job = await submitted_operation(runtime, "op-poll-only")
    async with polling(runtime, 0.05):
        await wait_for(lambda: _state_is(pool, "op-poll-only", "succeeded"), 15, "op-poll-only to succeed")
    baseline_gets = await job_gets(simulator, baseline_job)

    async with callback_runtime(settings, kafka_send, 60.0, "callbacks-worker") as rt, receiver(rt) as url:
        await simulator.configure(callback_url=url, callback_secret=SECRET)
        job_id = await submitted_operation(rt, "op-cb")
        poll_now_before = received("poll_now")
        async with polling(rt, IDLE_S):
            # the first GET saw the job queued: the next poll is the fallback's, a minute out
            await wait_for(lambda: _polled_once(pool, "op-cb"), 10, "the first poll of op-cb")
            wait_s = await pool.fetchval(
                "SELECT extract(epoch FROM next_poll_at - now()) FROM operations WHERE operation_id='op-cb'"
            )
            assert 55.0 < wait_s <= 60.0
            await wait_for(lambda: _state_is(pool, "op-cb", "succeeded"), 10, "op-cb to succeed after its callback")
        assert await delivered(pool, "op-cb") == 1
        assert await job_gets(simulator, job_id) == 2  # the first poll, then the one the callback made due
        assert baseline_gets >= 5, baseline_gets
        assert received("poll_now") == poll_now_before + 1
        rows = await pool.fetch("SELECT remote_job_id, operation_id, poll_made_due FROM callback_deliveries")
        assert [tuple(r) for r in rows] == [(job_id, "op-cb", True)]
        summary = (await simulator.get("/_sim/summary"))["callbacks"]
        assert (summary["scheduled"], summary["acknowledged"], summary["statuses"]) == (1, 1, {"204": 1})
    # `streams purge` deletes the record of its callbacks with the operation (the record stays bounded)
    await pool.execute("UPDATE outbox SET published_at = now()")
    await backdate(pool, "op-cb", "2 days")
    await backdate(pool, "op-poll-only", "2 days")
    assert (await retention.purge(pool, 86400.0, 10)).operations == 2
    assert await pool.fetchval("SELECT count(*) FROM callback_deliveries") == 0


async def test_a_worker_that_does_not_observe_the_job_takes_its_callback(
    settings: Settings, pool: asyncpg.Pool, simulator: Simulator, kafka_send: Any
) -> None:
    await long_jobs(simulator)
    async with (
        callback_runtime(settings, kafka_send, 60.0, "owner") as owner,
        callback_runtime(settings, kafka_send, 60.0, "web-only") as other,
        receiver(other) as url,
    ):
        await simulator.configure(callback_url=url, callback_secret=SECRET)
        job_id = await submitted_operation(owner, "op-elsewhere")
        async with polling(owner, 0.2):  # its scheduler's regular rounds find the due poll
            await wait_for(lambda: _polled_once(pool, "op-elsewhere"), 10, "the first poll of op-elsewhere")
            await wait_for(lambda: _state_is(pool, "op-elsewhere", "succeeded"), 10, "op-elsewhere to succeed")
        assert await job_gets(simulator, job_id) == 2
        assert other.wakeups.polls.notified and not owner.wakeups.polls.notified


async def test_refusals_and_replays_are_counted_and_change_nothing(
    settings: Settings, pool: asyncpg.Pool, simulator: Simulator, kafka_send: Any
) -> None:
    await long_jobs(simulator)
    async with callback_runtime(settings, kafka_send, 60.0, "callbacks-worker") as rt, receiver(rt) as url:
        job_id = await submitted_operation(rt, "op-refusals")
        await pool.execute("UPDATE operations SET next_poll_at = now() + interval '1 hour'")
        key = callback_secret_key(SECRET)

        def signed(webhook_id: str, body: bytes, *, key: bytes = key, age_s: int = 0) -> dict[str, str]:
            ts = int(time.time()) - age_s
            return {
                "webhook-id": webhook_id,
                "webhook-timestamp": str(ts),
                "webhook-signature": signature(key, webhook_id, ts, body),
            }

        def body(job: str) -> bytes:
            return orjson.dumps({"type": "generation.completed", "data": {"id": job, "status": "succeeded"}})

        cases = [
            ("bad_signature", 401, signed("msg_1", body(job_id), key=b"someone else's key"), body(job_id)),
            ("stale_timestamp", 401, signed("msg_2", body(job_id), age_s=301), body(job_id)),
            ("malformed_headers", 400, {"webhook-id": "msg_3"}, body(job_id)),
            ("malformed_body", 400, signed("msg_4", b'{"data": {}}'), b'{"data": {}}'),
            ("unknown_job", 404, signed("msg_5", body("job_unknown")), body("job_unknown")),
            ("body_too_large", 413, signed("msg_6", b"x" * 70_000), b"x" * 70_000),
        ]
        async with httpx.AsyncClient(timeout=10) as client:
            for reason, status, headers, content in cases:
                before = refused(reason)
                answer = await client.post(url, content=content, headers=headers)
                assert (reason, answer.status_code) == (reason, status)
                assert refused(reason) == before + 1, reason
            assert await pool.fetchval("SELECT count(*) FROM callback_deliveries") == 0
            assert await pool.fetchval("SELECT next_poll_at > now() + interval '50 minutes' FROM operations")

            # signed with the secret before the rotation: accepted, the poll made due
            old = signed("msg_ok", body(job_id), key=callback_secret_key(OLD_SECRET))
            assert (await client.post(url, content=body(job_id), headers=old)).status_code == 204
            assert await pool.fetchval("SELECT next_poll_at <= now() FROM operations")
            replays = refused("replay")
            again = await client.post(url, content=body(job_id), headers=old)
            assert (again.status_code, refused("replay")) == (200, replays + 1)
        assert await pool.fetchval("SELECT count(*) FROM callback_deliveries") == 1
        assert await state_of(pool, "op-refusals") == "submitted"  # a callback never saves a state


async def test_lost_or_badly_signed_callbacks_still_end_by_fallback_polling(
    settings: Settings, pool: asyncpg.Pool, simulator: Simulator, kafka_send: Any
) -> None:
    await long_jobs(simulator)
    async with callback_runtime(settings, kafka_send, 1.0, "callbacks-worker") as rt, receiver(rt) as url:
        await simulator.configure(callback_url=url, callback_secret=SECRET, callback_loss=1.0)
        lost_job = await submitted_operation(rt, "op-lost")
        bad_before = refused("bad_signature")
        async with polling(rt, 0.2):
            await wait_for(lambda: _state_is(pool, "op-lost", "succeeded"), 15, "op-lost to succeed by polling")
            await simulator.configure(callback_loss=0.0, callback_bad_signature=1.0, callback_attempts=2)
            await submitted_operation(rt, "op-bad")
            await wait_for(lambda: _state_is(pool, "op-bad", "succeeded"), 15, "op-bad to succeed by polling")
            await wait_for(lambda: _callbacks_done(simulator, 2), 10, "the badly signed callback's two attempts")
        # ~2 s of job at one GET per fallback second (not per 200 ms hint)
        assert 2 <= await job_gets(simulator, lost_job) <= 4
        assert await delivered(pool, "op-lost") == 1 and await delivered(pool, "op-bad") == 1
        summary = (await simulator.get("/_sim/summary"))["callbacks"]
        assert (summary["lost"], summary["bad_signature"], summary["statuses"]) == (1, 1, {"401": 2})
        assert refused("bad_signature") == bad_before + 2
        assert await pool.fetchval("SELECT count(*) FROM callback_deliveries") == 0


async def _state_is(pool: asyncpg.Pool, op: str, state: str) -> bool:
    return await state_of(pool, op) == state


async def _polled_once(pool: asyncpg.Pool, op: str) -> bool:
    return bool(await pool.fetchval("SELECT poll_count >= 1 FROM operations WHERE operation_id=$1", op))


async def _callbacks_done(simulator: Simulator, attempts: int) -> bool:
    return int((await simulator.get("/_sim/summary"))["callbacks"]["attempts"]) >= attempts
