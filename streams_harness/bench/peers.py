"""What the benchmark's peers (:mod:`~streams_harness.bench.naive`, :mod:`~streams_harness.bench.procrastinate_peer`)
share: their bounded consume loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any, Protocol

import orjson


class Record(Protocol):
    """A consumed Kafka record (aiokafka's ``ConsumerRecord``): only its value is read."""

    @property
    def value(self) -> bytes | None: ...


async def consume_bounded(
    records: AsyncIterable[Record], handle: Callable[[Any], Awaitable[None]], concurrency: int
) -> None:
    """Call ``handle`` with each record's decoded JSON value, in a task of its own, at most ``concurrency`` at once
    (after reading a record the loop waits for a free slot before it reads on). A record that does not decode, or
    whose handling raises, is skipped (the peers keep no dead letters; their consumer commits by itself). Returns
    once ``records`` ended and every handling finished; cancelling it cancels the handlings under way."""
    slots = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task[None]] = set()

    async def one(value: bytes | None) -> None:
        try:
            with contextlib.suppress(Exception):
                await handle(orjson.loads(value or b""))
        finally:
            slots.release()

    try:
        async for record in records:
            await slots.acquire()
            task = asyncio.create_task(one(record.value))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
