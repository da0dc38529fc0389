"""Upstream API: publish generation submissions to ``generation.submissions``, keyed by operation id."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaProducer

from streams.config import Settings
from streams.errors import InvalidEventError, JsonValueError
from streams.wire import contracts, exactjson, jsontext

#: A JSON object given as its text (carried verbatim) or as a mapping (written with :func:`exactjson.dumps`).
JsonObject = str | Mapping[str, Any]


def _json_text(value: JsonObject) -> str:
    """``value`` as JSON text; a text is checked to be one whole JSON value (it is spliced into the event).

    Raises:
        InvalidEventError: reason ``not_json``, ``number_out_of_range`` or ``too_deep``.
    """
    if isinstance(value, str):
        try:
            exactjson.loads(value, unique_keys=True)
        except JsonValueError as exc:
            raise InvalidEventError(exc.reason, f"a JSON text of the submission: {exc}") from exc
        return value
    return exactjson.dumps(value).decode()


def submission(
    operation_id: str,
    request: JsonObject,
    source: JsonObject | None = None,
    *,
    submitted_at_ms: int | str | None = None,
) -> bytes:
    """A submission value (``schemas/generation.submissions.json``).

    ``submitted_at_ms`` is the application's epoch ms (README "Submitting"): an int, or JSON text carried as
    written (the schema judges it); None stamps the current time. ``request`` and ``source`` given as JSON text are
    written into the value as they are, so that a number or a string reaches the provider exactly as written.

    Raises:
        InvalidEventError: a text is not one JSON value (nothing else is checked here: see
            :func:`checked_submission`).
    """
    if submitted_at_ms is None:
        stamp = str(int(time.time() * 1000))
    elif isinstance(submitted_at_ms, str):
        stamp = _json_text(submitted_at_ms)
    else:
        stamp = str(int(submitted_at_ms))
    parts = [
        f'"operation_id":{exactjson.dumps(operation_id).decode()}',
        f'"request":{_json_text(request)}',
        f'"submitted_at_ms":{stamp}',
    ]
    if source is not None:
        parts.append(f'"source":{_json_text(source)}')
    return ("{" + ",".join(parts) + "}").encode()


def checked_submission(
    operation_id: str,
    request: JsonObject,
    source: JsonObject | None = None,
    *,
    submitted_at_ms: int | str | None = None,
    max_value_bytes: int,
) -> bytes:
    """:func:`submission`, checked as a worker will check it (:func:`streams.wire.contracts.decode`): the value to
    publish, keyed by ``operation_id``.

    Raises:
        InvalidEventError: the value is not JSON, is over ``max_value_bytes`` bytes, or does not satisfy the
            submissions schema (the message names the field).
    """
    value = submission(operation_id, request, source, submitted_at_ms=submitted_at_ms)
    contracts.decode("generation.submissions", value, max_value_bytes)
    return value


#: The members of one line of a ``streams submit`` file; ``operation_id`` and ``request`` are required.
LINE_MEMBERS = ("operation_id", "request", "source", "submitted_at_ms")


def submissions_from_jsonl(text: str, max_value_bytes: int) -> list[tuple[str, bytes]]:
    """Every submission of a JSONL text (one ``{"operation_id", "request", "source"?, "submitted_at_ms"?}`` object
    a line, blank lines skipped), each checked by :func:`checked_submission`, as ``(operation_id, value)`` in file
    order. All or nothing: the caller publishes only when every line is good. ``request`` and ``source`` keep their
    text as written; a missing ``submitted_at_ms`` is stamped with the current time (ms).

    Raises:
        InvalidEventError: a line is not a JSON object with those members, or its submission is not valid; the
            message starts with ``line N:``.
    """
    out: list[tuple[str, bytes]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = exactjson.loads(line, unique_keys=True)
            if not isinstance(item, dict):
                raise InvalidEventError("schema", f"a line must be one JSON object, not {type(item).__name__}")
            unknown = sorted(set(item) - set(LINE_MEMBERS))
            missing = [key for key in ("operation_id", "request") if key not in item]
            if unknown or missing:
                raise InvalidEventError(
                    "schema",
                    f"a line holds {', '.join(LINE_MEMBERS[:2])} and optionally {', '.join(LINE_MEMBERS[2:])}"
                    + (f"; missing {', '.join(missing)}" if missing else "")
                    + (f"; unknown {', '.join(unknown)}" if unknown else ""),
                )
            texts = jsontext.member_texts(line)
            operation_id = item["operation_id"]
            if not isinstance(operation_id, str):
                raise InvalidEventError("schema", f"operation_id must be a string, not {texts['operation_id']}")
            value = checked_submission(
                operation_id,
                texts["request"],
                texts.get("source"),
                submitted_at_ms=texts.get("submitted_at_ms"),
                max_value_bytes=max_value_bytes,
            )
        except (InvalidEventError, JsonValueError) as exc:
            raise InvalidEventError(getattr(exc, "reason", "schema"), f"line {n}: {exc}") from exc
        out.append((operation_id, value))
    return out


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
        """Queue one submission stamped with the current time; returns a future that resolves when Kafka
        acknowledged it.

        ``request`` is the provider's request body (JSON text, carried verbatim, or a mapping).
        Numbers in a mapping are written exactly (``int`` of any size, ``Decimal``).

        Raises:
            InvalidEventError: the value is not JSON, is over ``max_value_bytes``, or does not satisfy the
                submissions schema (nothing is sent).
        """
        value = checked_submission(operation_id, request, source, max_value_bytes=self.settings.max_value_bytes)
        return await self.publish(operation_id, value)

    async def publish(self, operation_id: str, value: bytes) -> asyncio.Future[Any]:
        """Queue one value made by :func:`checked_submission` (keyed by ``operation_id``); returns a future that
        resolves when Kafka acknowledged it."""
        fut: asyncio.Future[Any] = await self._producer.send(self.topic, value, key=operation_id.encode())
        return fut
