"""Upstream API: publish generation submissions to ``generation.submissions``, keyed by operation id."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaProducer

from streams import contracts, exactjson
from streams.config import Settings
from streams.errors import InvalidEventError, JsonValueError

#: A JSON object given as its text (carried verbatim) or as a mapping (written with :func:`exactjson.dumps`).
JsonObject = str | Mapping[str, Any]


def _json_text(value: JsonObject) -> str:
    """``value`` as JSON text; a text is checked to be one whole JSON value (it is spliced into the event).

    Raises:
        InvalidEventError: reason ``not_json`` or ``number_out_of_range``.
    """
    if isinstance(value, str):
        try:
            exactjson.loads(value, unique_keys=True)
        except JsonValueError as exc:
            raise InvalidEventError(exc.reason, f"a JSON text of the submission: {exc}") from exc
        return value
    return exactjson.dumps(value).decode()


def submission(operation_id: str, request: JsonObject, source: JsonObject | None = None) -> bytes:
    """A submission value (``schemas/generation.submissions.json``) stamped with the current time (ms).

    Raises :class:`~streams.errors.InvalidEventError` when a text is not one JSON value.
    ``request`` and ``source`` given as JSON text are written into the value as they are, so that a number or a
    string reaches the provider exactly as written.
    """
    parts = [
        f'"operation_id":{exactjson.dumps(operation_id).decode()}',
        f'"request":{_json_text(request)}',
        f'"submitted_at_ms":{int(time.time() * 1000)}',
    ]
    if source is not None:
        parts.append(f'"source":{_json_text(source)}')
    return ("{" + ",".join(parts) + "}").encode()


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
        self, operation_id: str, request: JsonObject, source: JsonObject | None = None
    ) -> asyncio.Future[Any]:
        """Queue one submission; returns a future that resolves when Kafka acknowledged it.

        ``request`` is the provider's request body (JSON text, carried verbatim, or a mapping).
        Numbers in a mapping are written exactly (``int`` of any size, ``Decimal``).

        Raises:
            InvalidEventError: the value is not JSON, is over ``max_value_bytes``, or does not satisfy the
                submissions schema (nothing is sent).
        """
        value = submission(operation_id, request, source)
        contracts.decode("generation.submissions", value, self.settings.max_value_bytes)
        fut: asyncio.Future[Any] = await self._producer.send(self.topic, value, key=operation_id.encode())
        return fut
