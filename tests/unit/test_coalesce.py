"""The coalescer: requests of concurrent tasks share batches; each caller gets its own result or error."""

from __future__ import annotations

import asyncio

import pytest

from streams.coalesce import Coalescer


class Recorder:
    """A flush that records its batches and can be held on the wire."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def flush(self, requests: list[int]) -> list[int | BaseException]:
        self.batches.append(list(requests))
        await self.gate.wait()
        return [ValueError(f"odd {r}") if r % 2 else r * 10 for r in requests]


async def test_concurrent_requests_share_one_batch_and_get_their_own_results() -> None:
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush)
    results = await asyncio.gather(*(c.submit(i) for i in (2, 4, 6, 3)), return_exceptions=True)
    assert rec.batches == [[2, 4, 6, 3]]
    assert results[:3] == [20, 40, 60]
    assert isinstance(results[3], ValueError) and str(results[3]) == "odd 3"


async def test_requests_made_while_batches_are_on_the_wire_go_out_together_next() -> None:
    rec = Recorder()
    rec.gate.clear()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_in_flight=1)
    first = asyncio.ensure_future(c.submit(0))
    while not rec.batches:
        await asyncio.sleep(0)
    later = [asyncio.ensure_future(c.submit(i)) for i in (2, 4, 8)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert rec.batches == [[0]]  # the second batch waits for the first
    rec.gate.set()
    assert await first == 0
    assert await asyncio.gather(*later) == [20, 40, 80]
    assert rec.batches == [[0], [2, 4, 8]]


async def test_in_flight_and_queued_tell_what_waits_where() -> None:
    rec = Recorder()
    rec.gate.clear()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_in_flight=1)
    assert (c.in_flight, c.queued) == (0, 0)
    first = asyncio.ensure_future(c.submit(0))
    while not rec.batches:
        await asyncio.sleep(0)
    later = [asyncio.ensure_future(c.submit(i)) for i in (2, 4)]
    await asyncio.sleep(0)
    assert (c.in_flight, c.queued) == (1, 2)
    rec.gate.set()
    await asyncio.gather(first, *later)
    assert (c.in_flight, c.queued) == (0, 0)


async def test_max_batch_splits_a_queue() -> None:
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_batch=2, max_in_flight=4)
    assert await asyncio.gather(*(c.submit(i) for i in (2, 4, 6, 8, 10))) == [20, 40, 60, 80, 100]
    assert rec.batches == [[2, 4], [6, 8], [10]]


async def test_a_failed_flush_fails_every_caller_of_its_batch_only() -> None:
    calls: list[list[int]] = []

    async def flush(requests: list[int]) -> list[int | BaseException]:
        calls.append(list(requests))
        if len(calls) == 1:
            raise ConnectionError("service down")
        return list(requests)

    c: Coalescer[int, int] = Coalescer("test", flush)
    results = await asyncio.gather(c.submit(1), c.submit(2), return_exceptions=True)
    assert [type(r) for r in results] == [ConnectionError, ConnectionError]
    assert await c.submit(3) == 3
    assert calls == [[1, 2], [3]]


async def test_a_wrong_number_of_results_is_raised_not_misassigned() -> None:
    async def flush(requests: list[int]) -> list[int | BaseException]:
        return [1]

    c: Coalescer[int, int] = Coalescer("test", flush)
    results = await asyncio.gather(c.submit(1), c.submit(2), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and "1 results for 2 requests" in str(r) for r in results)


async def test_a_caller_cancelled_before_sending_takes_its_request_out() -> None:
    rec = Recorder()
    rec.gate.clear()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_in_flight=1)
    first = asyncio.ensure_future(c.submit(0))
    while not rec.batches:
        await asyncio.sleep(0)
    queued = asyncio.ensure_future(c.submit(2))
    kept = asyncio.ensure_future(c.submit(4))
    await asyncio.sleep(0)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    rec.gate.set()
    assert (await first, await kept) == (0, 40)
    assert rec.batches == [[0], [4]]


async def test_a_caller_cancelled_on_the_wire_does_not_stop_its_batch() -> None:
    rec = Recorder()
    rec.gate.clear()
    c: Coalescer[int, int] = Coalescer("test", rec.flush)
    gone = asyncio.ensure_future(c.submit(2))
    stays = asyncio.ensure_future(c.submit(4))
    while not rec.batches:
        await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    rec.gate.set()
    assert await stays == 40
    await c.drain()
    assert rec.batches == [[2, 4]]


async def test_a_request_made_while_nothing_is_in_flight_is_flushed_in_the_next_pass_of_the_loop() -> None:
    """One pass to let the tasks already ready join, none more: the batch's task takes the queue and starts the
    flush in the same step (each extra pass costs every request of a busy worker one turn of its event loop)."""
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush)
    first = asyncio.ensure_future(c.submit(2))
    joins = asyncio.ensure_future(c.submit(4))
    await asyncio.sleep(0)  # both submit
    assert rec.batches == []
    await asyncio.sleep(0)  # the next pass: both in one batch, flushed
    assert rec.batches == [[2, 4]]
    assert list(await asyncio.gather(first, joins)) == [20, 40]


async def test_a_burst_of_5000_requests_with_cancellations_stays_bounded_ordered_and_answered() -> None:
    """5,000 requests at once, every third caller cancelled while it waits in the queue: every other request is
    sent exactly once, in the order made (no request overtaken by later ones), in batches of at most
    ``max_batch`` with at most ``max_in_flight`` on the wire, and each caller gets its own answer."""
    on_wire = 0
    most_on_wire = 0
    batches: list[list[int]] = []
    gate = asyncio.Event()

    async def flush(requests: list[int]) -> list[int]:
        nonlocal on_wire, most_on_wire
        on_wire += 1
        most_on_wire = max(most_on_wire, on_wire)
        batches.append(list(requests))
        await gate.wait()
        await asyncio.sleep(0)
        on_wire -= 1
        return [r * 2 for r in requests]

    c: Coalescer[int, int] = Coalescer("burst", flush, max_batch=256, max_in_flight=2)
    started = asyncio.get_running_loop().time()
    tasks = [asyncio.ensure_future(c.submit(i)) for i in range(5000)]
    while len(batches) < 2:
        await asyncio.sleep(0)
    assert c.queued == 5000 - 2 * 256
    cancelled = [i for i in range(2 * 256, 5000) if i % 3 == 0]
    for i in cancelled:
        tasks[i].cancel()
    await asyncio.sleep(0)
    assert c.queued == 5000 - 2 * 256 - len(cancelled)  # taken out of the queue, never sent
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = asyncio.get_running_loop().time() - started
    sent = [r for batch in batches for r in batch]
    expected = [i for i in range(5000) if i not in set(cancelled)]
    assert sent == expected  # each once, in the order made
    assert max(len(b) for b in batches) <= 256 and most_on_wire <= 2
    assert len(batches) == -(-len(expected) // 256)
    assert [results[i] for i in expected] == [i * 2 for i in expected]
    assert all(isinstance(results[i], asyncio.CancelledError) for i in cancelled)
    assert (c.queued, c.in_flight) == (0, 0)
    assert elapsed < 5.0, f"5,000 requests took {elapsed:.2f} s"


async def test_a_batch_task_cancelled_before_it_started_does_not_stop_the_stage() -> None:
    """Cancelling the scheduled batch task before its first step (a shutdown racing a request, a cancelled scope)
    must not leave the stage believing a batch is on its way: the queued request still goes out."""
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush)
    waiting = asyncio.ensure_future(c.submit(2))
    await asyncio.sleep(0)  # the request is queued and its batch task scheduled, not yet run
    (scheduled,) = c._tasks
    scheduled.cancel()
    assert await asyncio.wait_for(waiting, timeout=2) == 20
    assert rec.batches == [[2]]
    assert await asyncio.wait_for(c.submit(4), timeout=2) == 40  # and the stage keeps going


async def _passes(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_under_load_a_batch_lingers_for_the_requests_that_follow() -> None:
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_in_flight=1, linger_s=30.0)
    assert list(await asyncio.gather(c.submit(2), c.submit(4))) == [20, 40]  # a batch of two: load
    first = asyncio.ensure_future(c.submit(6))
    await _passes(10)
    assert rec.batches == [[2, 4]]  # the next batch waits for more (up to linger_s)
    second = asyncio.ensure_future(c.submit(8))
    await _passes(10)
    assert rec.batches == [[2, 4]] and c.queued == 2
    # Cancelling the lingering batch before it starts leaves its requests to the next batch.
    lingering = c._not_started
    assert lingering is not None
    lingering.cancel()
    c.linger_s = 0.0
    assert list(await asyncio.wait_for(asyncio.gather(first, second), 5)) == [60, 80]
    assert rec.batches == [[2, 4], [6, 8]]


async def test_at_low_load_a_batch_goes_at_once() -> None:
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_in_flight=1, linger_s=30.0)
    for i in (2, 4, 6):  # one request at a time: batches of one, none waits
        assert await asyncio.wait_for(c.submit(i), 5) == i * 10
    assert rec.batches == [[2], [4], [6]]


async def test_a_full_queue_does_not_linger() -> None:
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_batch=2, max_in_flight=1, linger_s=30.0)
    assert list(await asyncio.gather(c.submit(2), c.submit(4))) == [20, 40]
    assert list(await asyncio.wait_for(asyncio.gather(c.submit(6), c.submit(8)), 5)) == [60, 80]
    assert rec.batches == [[2, 4], [6, 8]]


def test_a_negative_linger_is_refused() -> None:
    with pytest.raises(ValueError, match="linger_s"):
        Coalescer("test", Recorder().flush, linger_s=-1.0)


async def test_a_lingering_batch_goes_by_itself_after_linger_s() -> None:
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_in_flight=1, linger_s=0.05)
    assert list(await asyncio.gather(c.submit(2), c.submit(4))) == [20, 40]
    loop = asyncio.get_running_loop()
    submitted_at = loop.time()
    assert await asyncio.wait_for(c.submit(6), 5) == 60
    assert loop.time() - submitted_at >= 0.04  # it waited for more (the loop's timer resolution aside)
    assert rec.batches == [[2, 4], [6]]


async def test_after_a_burst_and_an_idle_spell_a_lone_request_goes_at_once() -> None:
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_in_flight=1, linger_s=0.2)
    assert list(await asyncio.gather(c.submit(2), c.submit(4))) == [20, 40]  # a burst: a batch of two
    loop = asyncio.get_running_loop()
    idle_until = loop.time() + 0.2
    while loop.time() <= idle_until:  # the stage idles for longer than linger_s: no load any more
        await asyncio.sleep(0.02)
    lone = asyncio.ensure_future(c.submit(6))
    await _passes(3)
    assert rec.batches == [[2, 4], [6]]  # sent in the next pass, not after linger_s
    assert await lone == 60


async def test_callers_cancelled_while_their_batch_lingers_send_nothing() -> None:
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_in_flight=1, linger_s=0.05)
    assert list(await asyncio.gather(c.submit(2), c.submit(4))) == [20, 40]
    gone, stays = asyncio.ensure_future(c.submit(6)), asyncio.ensure_future(c.submit(8))
    await _passes(5)
    assert c.queued == 2 and rec.batches == [[2, 4]]
    gone.cancel()
    assert await asyncio.wait_for(stays, 5) == 80
    assert rec.batches == [[2, 4], [8]]
    assert list(await asyncio.gather(c.submit(10), c.submit(12))) == [100, 120]  # load again
    alone = asyncio.ensure_future(c.submit(14))
    await _passes(5)
    alone.cancel()  # every caller of the lingering batch went away: nothing is sent
    await asyncio.wait_for(c.drain(), 5)
    assert rec.batches == [[2, 4], [8], [10, 12]]
    assert await asyncio.wait_for(c.submit(16), 5) == 160  # and the stage keeps going


async def test_drain_waits_for_a_lingering_batch_even_when_its_task_is_cancelled() -> None:
    rec = Recorder()
    c: Coalescer[int, int] = Coalescer("test", rec.flush, max_in_flight=1, linger_s=0.05)
    assert list(await asyncio.gather(c.submit(2), c.submit(4))) == [20, 40]
    waiting = asyncio.ensure_future(c.submit(6))
    await _passes(5)
    draining = asyncio.ensure_future(c.drain())
    await _passes(5)
    lingering = c._not_started
    assert lingering is not None and not draining.done()
    lingering.cancel()  # e.g. at shutdown: its request goes in the next batch, which drain waits for
    await asyncio.wait_for(draining, 5)
    assert waiting.done() and waiting.result() == 60
    assert rec.batches == [[2, 4], [6]]
    assert (c.in_flight, c.queued) == (0, 0)
