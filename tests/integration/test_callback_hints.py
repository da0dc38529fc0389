"""A completion callback that comes while its job's poll is claimed or being observed (docs/callbacks.md, "A
callback during a poll"), against PostgreSQL, Redis and the provider simulator: the callback's news is never left
to the fallback poll, and it costs at most one extra GET. A cancellation recorded during a poll likewise wakes the
observing worker's scheduler at once.

The callback or the cancellation is recorded between the GET and its save, deterministically: from the observer's
``OBSERVED_BEFORE_SAVE`` hook, by another connection in a thread of its own (the hook is synchronous and blocks
the worker's event loop meanwhile, as a paused worker would be)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import asyncpg
import httpx
import orjson
import pytest

from streams import hooks
from streams.config import Settings, callback_secret_key
from streams.ledger.pool import create_pool
from streams.ledger.records import CallbackNote, CancelAsk, CancelPath
from streams.ledger.store import Ledger
from streams.remote.callbacks import signature
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.observer import Observer
from tests.integration.test_callbacks import SECRET, callback_runtime, job_gets, long_jobs, received, receiver
from tests.integration.test_cancellation import next_poll_in_s
from tests.integration.test_observer import claim_poll, submitted_operation
from tests.support import SimulatorServer as Simulator

pytestmark = pytest.mark.integration

#: The fallback poll interval of these runtimes (s): a poll left to it is this far out.
FALLBACK_S = 60.0

T = TypeVar("T")


def in_own_thread(settings: Settings, act: Callable[[Ledger], Awaitable[T]]) -> T:
    """Run ``act`` on a ledger of its own (its own pool, event loop and thread) and wait for it: another worker's
    write, made while this one's event loop is held."""
    results: list[T] = []

    async def run() -> None:
        pool = await create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=1)
        try:
            results.append(await act(Ledger(pool, "callback-receiver", batching=False)))
        finally:
            await pool.close()

    thread = threading.Thread(target=lambda: asyncio.run(run()))
    thread.start()
    thread.join()
    assert len(results) == 1, "the write in its own thread failed"
    return results[0]


@pytest.fixture
def before_save() -> Iterator[list[Callable[[], None]]]:
    """Actions run once each at the observer's ``OBSERVED_BEFORE_SAVE`` (between the GET and its save)."""
    actions: list[Callable[[], None]] = []
    hooks.install(hooks.HookPoint.OBSERVED_BEFORE_SAVE, lambda **_: actions.pop(0)() if actions else None)
    yield actions
    hooks.clear()


@pytest.fixture
async def rt(settings: Settings, kafka_send: Any, simulator: Simulator) -> AsyncIterator[Runtime]:
    """A worker runtime with callbacks on (fallback :data:`FALLBACK_S`) over jobs queued long enough that every
    GET here reads them queued."""
    await long_jobs(simulator)
    await simulator.configure(queue_ms=600_000)
    async with callback_runtime(settings, kafka_send, FALLBACK_S, "hints-worker") as runtime:
        yield runtime


async def test_a_callback_during_a_get_leaves_the_next_poll_due_at_once(
    settings: Settings, rt: Runtime, pool: asyncpg.Pool, simulator: Simulator, before_save: list[Callable[[], None]]
) -> None:
    """The GET read the job queued; the callback came before its save (made_due: the poll was not claimed). The
    save leaves the next poll due now instead of the fallback's minute and wakes this worker's scheduler; the
    poll after it, with no callback during it, waits for the fallback again (one extra GET per callback)."""
    job_id = await submitted_operation(rt, "op-mid")
    notes: list[CallbackNote] = []
    before_save.append(lambda: notes.append(in_own_thread(settings, lambda lg: lg.note_callback("msg_mid", job_id))))
    assert not rt.wakeups.polls.notified
    await Observer(rt).handle(await claim_poll(rt, "op-mid"))
    assert [(n.operation_id, n.recorded, n.made_due) for n in notes] == [("op-mid", True, True)]
    assert await next_poll_in_s(pool, "op-mid") <= 0  # on the old code: the fallback's 60 s
    assert rt.wakeups.polls.notified  # on the old code: a deadline 60 s out only
    assert notes[0].hinted
    assert await pool.fetchval("SELECT hinted_at FROM operations WHERE operation_id='op-mid'") is None
    # A replay of the delivery during the next poll changes nothing: that poll's save applies the fallback.
    before_save.append(lambda: notes.append(in_own_thread(settings, lambda lg: lg.note_callback("msg_mid", job_id))))
    await Observer(rt).handle(await claim_poll(rt, "op-mid"))
    assert (notes[1].recorded, notes[1].made_due, notes[1].hinted) == (False, False, False)
    assert FALLBACK_S - 5 < await next_poll_in_s(pool, "op-mid") <= FALLBACK_S
    assert await job_gets(simulator, job_id) == 2
    rows = await pool.fetch("SELECT webhook_id, poll_made_due FROM callback_deliveries")
    assert [tuple(r) for r in rows] == [("msg_mid", True)]


async def test_several_callbacks_during_one_get_cost_one_extra_get(
    settings: Settings, rt: Runtime, pool: asyncpg.Pool, simulator: Simulator, before_save: list[Callable[[], None]]
) -> None:
    """Three deliveries (distinct webhook ids) during one GET: one poll due now, not three; the next save, with
    none during it, applies the fallback."""
    job_id = await submitted_operation(rt, "op-many")

    async def three(lg: Ledger) -> list[CallbackNote]:
        return [await lg.note_callback(f"msg_many_{i}", job_id) for i in range(3)]

    notes: list[list[CallbackNote]] = []
    before_save.append(lambda: notes.append(in_own_thread(settings, three)))
    await Observer(rt).handle(await claim_poll(rt, "op-many"))
    assert [n.made_due for n in notes[0]] == [True, False, False]
    assert await next_poll_in_s(pool, "op-many") <= 0  # on the old code: the fallback's 60 s
    assert [n.hinted for n in notes[0]] == [True, False, False]  # the poll was due already for the 2nd and 3rd
    await Observer(rt).handle(await claim_poll(rt, "op-many"))
    assert FALLBACK_S - 5 < await next_poll_in_s(pool, "op-many") <= FALLBACK_S
    assert await job_gets(simulator, job_id) == 2


async def test_a_callback_while_the_poll_is_claimed_is_served_by_that_poll(
    rt: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """The poll is claimed (its event on its way) when the callback comes: nothing moves (``poll_claimed``), and
    that poll's GET comes after the callback, so its save applies the fallback: no extra GET."""
    job_id = await submitted_operation(rt, "op-claimed")
    event = await claim_poll(rt, "op-claimed")
    before = received("poll_claimed")
    body = f'{{"type": "generation.completed", "data": {{"id": "{job_id}", "status": "succeeded"}}}}'.encode()
    now_s = int(time.time())
    headers = {
        "webhook-id": "msg_claimed",
        "webhook-timestamp": str(now_s),
        "webhook-signature": signature(callback_secret_key(SECRET), "msg_claimed", now_s, body),
    }
    async with receiver(rt) as url, httpx.AsyncClient() as http:
        answer = await http.post(url, content=body, headers=headers)
    assert answer.status_code == 204
    assert received("poll_claimed") == before + 1
    assert not rt.wakeups.polls.notified  # nothing was made due
    await Observer(rt).handle(event)
    assert FALLBACK_S - 5 < await next_poll_in_s(pool, "op-claimed") <= FALLBACK_S
    assert await job_gets(simulator, job_id) == 1


async def test_a_cancel_during_a_get_wakes_the_observing_workers_scheduler(
    settings: Settings, rt: Runtime, pool: asyncpg.Pool, before_save: list[Callable[[], None]]
) -> None:
    """A cancellation recorded during the GET: the save leaves the next poll due now (as before) and the observer
    now wakes its own scheduler, instead of leaving the poll to the scheduler's fallback round."""
    await submitted_operation(rt, "op-cancel-mid")
    asks: list[CancelAsk] = []

    def cancel() -> None:
        asks.append(
            in_own_thread(
                settings, lambda lg: lg.request_cancel("op-cancel-mid", CancelPath.OPERATOR, "alice", "mid GET")
            )
        )

    before_save.append(cancel)
    await Observer(rt).handle(await claim_poll(rt, "op-cancel-mid"))
    assert [a.recorded for a in asks] == [True]
    assert await next_poll_in_s(pool, "op-cancel-mid") <= 0
    assert rt.wakeups.polls.notified  # on the old code: a deadline 60 s out only


async def test_a_poll_claimed_after_the_callback_serves_it_without_another_claim(
    settings: Settings, rt: Runtime, pool: asyncpg.Pool, simulator: Simulator, before_save: list[Callable[[], None]]
) -> None:
    """The callback made the poll due during the GET and a scheduler claimed the next poll before the save: that
    claimed poll's GET comes after the callback, so the save leaves it be (no second claim, no stale poll event),
    and it is the one extra GET."""
    job_id = await submitted_operation(rt, "op-reclaimed")
    claimed: list[list[str]] = []

    async def callback_then_claim(lg: Ledger) -> list[str]:
        assert (await lg.note_callback("msg_reclaimed", job_id)).made_due
        return [p.operation_id for p in await lg.claim_due_polls(100, 3.0)]

    before_save.append(lambda: claimed.append(in_own_thread(settings, callback_then_claim)))
    first = await claim_poll(rt, "op-reclaimed")
    await Observer(rt).handle(first)
    assert claimed == [["op-reclaimed"]]
    assert await next_poll_in_s(pool, "op-reclaimed") > FALLBACK_S - 5  # the claimed poll is on its way
    assert first.value is not None
    poll_claim_id = await pool.fetchval("SELECT poll_claim_id FROM operations WHERE operation_id='op-reclaimed'")
    event = orjson.loads(first.value) | {"poll_claim_id": poll_claim_id}
    await Observer(rt).handle(RawMessage(first.topic, 0, 1, first.key, orjson.dumps(event)))
    assert await job_gets(simulator, job_id) == 2
    assert FALLBACK_S - 5 < await next_poll_in_s(pool, "op-reclaimed") <= FALLBACK_S
