"""Upstream API: publish generation submissions to ``generation.submissions``, keyed by operation id."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import tenacity
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaTimeoutError, OutOfOrderSequenceNumber

from streams.bounded import close_within
from streams.config import Settings
from streams.errors import InvalidEventError, JsonValueError
from streams.kafka_security import new_producer, raise_for_security
from streams.metrics import SUBMISSION_PRODUCER_START_RETRIES, SUBMISSION_RESENDS
from streams.outages import is_outage
from streams.wire import contracts, exactjson, jsontext

log = logging.getLogger(__name__)

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

    ``submitted_at_ms`` is the application's epoch ms (docs/guarantees.md, "Submissions"): an int, or JSON text
    carried as written (the schema judges it); None stamps the current time. ``request`` and ``source`` given as
    JSON text are written into the value as they are, so that a number or a string reaches the provider exactly
    as written.

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


#: Times one submission is sent again after the batch carrying it failed (then its future fails).
RESEND_ATTEMPTS = 3
#: First and longest wait (s) between starts of a replacement producer that found no broker (exponential, jittered).
START_RETRY_INITIAL_S = 0.1
START_RETRY_MAX_S = 2.0
#: Longest a producer that did not start is given to stop when its start was cancelled (s; Ctrl-C): a stop may
#: flush for ``kafka_delivery_timeout_s`` otherwise.
STOP_ON_CANCEL_S = 1.0


def needs_new_producer(exc: BaseException) -> bool:
    """True when a failed send leaves aiokafka's idempotent producer unusable for its partition, or is an outage a
    fresh producer may get past: a batch past its delivery timeout (``KafkaTimeoutError``: its sequence numbers
    were spent, so every later batch to that partition fails with ``OutOfOrderSequenceNumber``), that error
    itself, and the outages of :func:`streams.outages.is_outage`. Anything else (a record too large, an
    authorization refusal) fails the submission."""
    return isinstance(exc, (KafkaTimeoutError, OutOfOrderSequenceNumber)) or is_outage(exc)


@dataclass(eq=False)
class _Pending:
    """One submission not yet acknowledged: its key and value, the future its caller holds, the producer
    generation it was last sent with (0: not sent yet) and how many times it was sent again."""

    key: bytes
    value: bytes
    future: asyncio.Future[Any]
    generation: int = 0
    resends: int = 0


class SubmissionProducer:
    """Publishes submissions; each value is checked against its schema before it is sent.

    Use as ``async with SubmissionProducer(settings) as p: await p.submit(...)``. The producer is idempotent with
    ``acks=all`` (:func:`streams.kafka_security.new_producer`). When a batch fails in a way that leaves it
    unusable (:func:`needs_new_producer`), the producer is replaced by a new one and every submission not yet
    acknowledged is sent again in the order it was first published (at most :data:`RESEND_ATTEMPTS` times each;
    each time logged and counted in ``streams_submission_resends_total``). A submission whose first copy was
    written after all is then in the topic twice: the workers accept an operation id once (the ledger's
    idempotent accept), so none is lost, reordered among those sent again, or handled twice.

    A new producer that cannot start for an outage (the cluster restarting: no broker answers its bootstrap) is
    started again, waits growing from :data:`START_RETRY_INITIAL_S` to :data:`START_RETRY_MAX_S`, until
    ``kafka_delivery_timeout_s`` after the failure (each retry logged and counted in
    ``streams_submission_producer_start_retries_total``); then what is pending fails with that outage, and the
    next submission published tries a new producer again.

    ``producer_factory`` makes each producer (default: an ``AIOKafkaProducer`` from the settings; tests pass
    their own).
    """

    def __init__(self, settings: Settings, producer_factory: Callable[[], AIOKafkaProducer] | None = None) -> None:
        self.settings = settings
        self.topic = settings.topic("submissions")
        self._factory = producer_factory or (lambda: new_producer(settings, linger_ms=5))
        self._producer = self._factory()
        self._generation = 1
        self._pending: dict[_Pending, None] = {}  # insertion-ordered: publication order
        self._recovery: asyncio.Task[None] | None = None
        self._recover_again: BaseException | None = None
        self._unstarted: BaseException | None = None  # why the last replacement did not start (None: it did)

    async def __aenter__(self) -> SubmissionProducer:
        """Start the producer within ``kafka_delivery_timeout_s``.

        Raises:
            KafkaTimeoutError: it did not start by then (aiokafka's idempotent start waits for its producer id
                without a limit); KafkaSecurityError: a wrong security setting; KafkaError, OSError: as aiokafka.
        """
        try:
            await self._start(self._producer)
        except Exception as exc:
            await raise_for_security(self.settings, exc)  # KafkaSecurityError: a wrong security setting
            raise
        return self

    async def _start(self, producer: AIOKafkaProducer) -> None:
        """Start ``producer`` within ``kafka_delivery_timeout_s``; one that did not start is stopped (it still holds
        its client; within that time again, :data:`STOP_ON_CANCEL_S` when cancelled), and the error raised (a
        :class:`KafkaTimeoutError` for the time limit)."""
        limit_s = self.settings.kafka_delivery_timeout_s
        bound = asyncio.timeout(limit_s)
        try:
            async with bound:
                await producer.start()
        except BaseException as exc:
            stop_s = limit_s if isinstance(exc, Exception) else STOP_ON_CANCEL_S
            await close_within(producer.stop(), stop_s, "the submission producer")
            if isinstance(exc, TimeoutError) and bound.expired():
                raise KafkaTimeoutError(f"the submission producer did not start within {limit_s:g} s") from None
            raise

    async def __aexit__(self, *exc: object) -> None:
        """Wait for a resend under way, then stop the producer (its flush at most ``kafka_delivery_timeout_s``)."""
        while self._recovery is not None:
            await asyncio.gather(self._recovery, return_exceptions=True)
        limit_s = self.settings.kafka_delivery_timeout_s
        if not await close_within(self._producer.stop(), limit_s, "the submission producer"):
            for entry in list(self._pending):  # their flush was cut off: failed, never left pending for good
                if not entry.future.done():
                    entry.future.set_exception(KafkaTimeoutError(f"not acknowledged within {limit_s:g} s"))
            self._pending.clear()

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
        resolves with Kafka's record metadata when acknowledged, or fails with the send's error once the
        submission failed :data:`RESEND_ATTEMPTS` resends or failed for a reason a new producer cannot help."""
        entry = _Pending(operation_id.encode(), value, asyncio.get_running_loop().create_future())
        self._pending[entry] = None
        if self._recovery is not None:  # the resend loop sends it, after the older ones
            pass
        elif self._unstarted is not None:  # the last replacement never started: another one sends it
            self._recovery = asyncio.get_running_loop().create_task(self._recover(self._unstarted))
        else:
            await self._send(entry)
        return entry.future

    async def _send(self, entry: _Pending) -> None:
        generation = entry.generation = self._generation
        try:
            sent: asyncio.Future[Any] = await self._producer.send(self.topic, entry.value, key=entry.key)
        except Exception as exc:
            self._failed(entry, generation, exc)
            return
        sent.add_done_callback(lambda fut: self._done(entry, generation, fut))

    def _done(self, entry: _Pending, generation: int, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            self._failed(entry, generation, asyncio.CancelledError())
        elif fut.exception() is not None:
            self._failed(entry, generation, fut.exception())  # type: ignore[arg-type]
        else:  # written: also when by a producer replaced since (it is then not sent again)
            self._pending.pop(entry, None)
            if not entry.future.done():
                entry.future.set_result(fut.result())

    def _failed(self, entry: _Pending, generation: int, exc: BaseException) -> None:
        if entry not in self._pending or generation != self._generation:
            return  # acknowledged meanwhile, or a failure of a replaced producer: the resend loop has it
        if not needs_new_producer(exc) or entry.resends >= RESEND_ATTEMPTS:
            self._pending.pop(entry, None)
            if not entry.future.done():
                entry.future.set_exception(exc)
            return
        if self._recovery is None:
            self._recovery = asyncio.get_running_loop().create_task(self._recover(exc))
        else:  # a resend of the running recovery failed: one more recovery after it
            self._recover_again = exc

    async def _recover(self, exc: BaseException) -> None:
        """Replace the producer and send every unacknowledged submission again, in publication order."""
        old = self._producer
        self._generation += 1
        reason = type(exc).__name__
        try:
            try:  # its callbacks run now: what it did write is acknowledged, the rest stays pending
                async with asyncio.timeout(self.settings.kafka_delivery_timeout_s):
                    await old.stop()
            except Exception as stop_exc:  # a stuck or broken producer: dropped either way
                log.debug("submission producer: the replaced producer stopped with %r", stop_exc)
            log.warning(
                "submission producer: a send to %s failed (%s); sending the %d unacknowledged submissions again "
                "with a new producer, in order",
                self.topic,
                reason,
                len(self._pending),
            )
            self._producer = await self._start_replacement()
            self._unstarted = None
            while True:
                unsent = [entry for entry in self._pending if entry.generation != self._generation]
                if not unsent:
                    break
                for entry in unsent:
                    if entry.generation:  # sent before: a resend
                        entry.resends += 1
                        SUBMISSION_RESENDS.labels(reason=reason).inc()
                    await self._send(entry)
        except Exception as recover_exc:  # the new producer cannot start: fail what is pending
            self._unstarted = recover_exc
            for entry in list(self._pending):
                self._pending.pop(entry, None)
                if not entry.future.done():
                    entry.future.set_exception(recover_exc)
        finally:
            self._recovery = None
            again, self._recover_again = self._recover_again, None
            if again is not None and self._pending:
                self._recovery = asyncio.get_running_loop().create_task(self._recover(again))

    async def _start_replacement(self) -> AIOKafkaProducer:
        """A new started producer; a start that fails for an outage is retried (see the class docstring).

        Raises:
            The last start's error: not an outage, or an outage still there ``kafka_delivery_timeout_s`` on.
        """

        def retried(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            reason = type(exc).__name__
            SUBMISSION_PRODUCER_START_RETRIES.labels(reason=reason).inc()
            log.warning(
                "submission producer: a new producer could not start (%s: no broker answered); starting another "
                "in %.1f s, for at most %.0f s in all",
                reason,
                state.upcoming_sleep,
                self.settings.kafka_delivery_timeout_s,
            )

        async def start() -> AIOKafkaProducer:
            producer = self._factory()
            await self._start(producer)
            return producer

        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(is_outage),
            stop=tenacity.stop_after_delay(self.settings.kafka_delivery_timeout_s),
            wait=tenacity.wait_exponential_jitter(
                multiplier=START_RETRY_INITIAL_S, max=START_RETRY_MAX_S, jitter=START_RETRY_INITIAL_S
            ),
            before_sleep=retried,
            reraise=True,
        )
        return await retrying(start)
