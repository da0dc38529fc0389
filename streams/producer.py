"""Upstream API: publish generation submissions to ``generation.submissions``, keyed by operation id."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka import AIOKafkaProducer

from streams import contracts, exactjson
from streams.config import Settings


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

        Numbers in ``request`` and ``source`` are written exactly (``int`` of any size, ``Decimal``); read the
        input with :func:`streams.exactjson.loads` so that none is rounded on the way in.

        Raises:
            InvalidEventError: the value does not satisfy the submissions schema (nothing is sent).
        """
        value = submission(operation_id, request, source)
        contracts.validate("generation.submissions", value)
        fut: asyncio.Future[Any] = await self._producer.send(
            self.topic, exactjson.dumps(value), key=operation_id.encode()
        )
        return fut
