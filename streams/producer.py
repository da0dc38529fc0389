"""Upstream API: publish generation submissions to ``generation.submissions``, keyed by operation id."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer

from streams import contracts
from streams.config import Settings
from streams.trace import TraceRow


def submission(operation_id: str, request: dict[str, Any], source: dict[str, Any] | None = None) -> dict[str, Any]:
    """A submission value (``schemas/generation.submissions.json``) stamped with the current time (ms)."""
    value: dict[str, Any] = {
        "operation_id": operation_id,
        "request": request,
        "submitted_at_ms": int(time.time() * 1000),
    }
    if source is not None:
        value["source"] = source
    return value


class SubmissionProducer:
    """Publishes submissions; each value is checked against its schema before it is sent.

    Use as ``async with SubmissionProducer(settings) as p: await p.submit(...)``.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = settings.topic("submissions")
        self._producer = AIOKafkaProducer(
            bootstrap_servers=settings.kafka_bootstrap, acks="all", linger_ms=5, enable_idempotence=True
        )

    async def __aenter__(self) -> SubmissionProducer:
        await self._producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._producer.stop()

    async def submit(
        self, operation_id: str, request: dict[str, Any], source: dict[str, Any] | None = None
    ) -> asyncio.Future[Any]:
        """Queue one submission; returns a future that resolves when Kafka acknowledged it.

        Raises:
            InvalidEventError: the value does not satisfy the submissions schema (nothing is sent).
        """
        value = submission(operation_id, request, source)
        contracts.validate("generation.submissions", value)
        fut: asyncio.Future[Any] = await self._producer.send(self.topic, orjson.dumps(value), key=operation_id.encode())
        return fut

    async def send_raw(self, key: bytes | None, value: bytes) -> None:
        """Send arbitrary bytes to the submissions topic (tests of bad input); waits for the ack."""
        await self._producer.send_and_wait(self.topic, value, key=key)


def trace_request(row: TraceRow, model: str) -> dict[str, Any]:
    """The generation request for one trace row."""
    return {"model": model, "context_tokens": row.context_tokens, "generated_tokens": row.generated_tokens}


async def replay_trace(
    producer: SubmissionProducer,
    rows: Iterable[TraceRow],
    *,
    trace: str,
    run_id: str,
    compression: float,
    model: str,
    on_sent: Callable[[int], None] | None = None,
) -> list[str]:
    """Publish ``rows`` at their trace arrival times divided by ``compression``; returns the operation ids.

    Operation ids are ``<run_id>-<trace>-<row>`` so a run can be replayed without colliding with another.
    """
    started = time.monotonic()
    ids: list[str] = []
    pending: list[asyncio.Future[Any]] = []
    for row in rows:
        due = started + row.arrival_s / compression
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        operation_id = f"{run_id}-{trace}-{row.row:06d}"
        source = {"trace": trace, "row": row.row, "arrival_s": row.arrival_s}
        pending.append(await producer.submit(operation_id, trace_request(row, model), source))
        ids.append(operation_id)
        if on_sent is not None:
            on_sent(len(ids))
    await asyncio.gather(*pending)
    return ids
