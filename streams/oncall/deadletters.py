"""Dead letters a person can act on: ``streams dead-letters list|show|redrive``.

The dead-letter topic's records are the envelopes of ``schemas/generation.dead-letter.json`` (written by
:meth:`streams.worker.runtime.Runtime.dead_letter`); each is named here by its place in that topic,
``PARTITION:OFFSET`` (:func:`parse_record`). Reading is bounded: at most ``limit`` matching records, within
``timeout_s`` seconds, with no consumer group (nothing is committed); a scan that stops early says so.

A re-drive publishes a submission again to the topic it came from, keyed by its operation id: the dead letter's
original value, or a fixed value from a file. It is refused when the value is still invalid, when the original
was cut (``original_truncated``) and no fixed value is given, when the dead letter did not come from the
submissions topic (the other topics' events are the workers' own), when the ledger holds the operation with
another request (compared by canonical form, :func:`streams.wire.jsontext.canonical`, as the dispatcher compares
replays), and when the ledger no longer holds the operation of its id (``streams purge --ids-older-than`` freed it)
while the accounting has a POST for it or the letter was refused as its duplicate: it would run again as a new
operation. Each re-drive is recorded in the ledger (``dead_letter_redrives``: which record, where it went, the
value's SHA-256, why, by whom).

Payloads (the original value, which holds a user's prompt) are never logged; :func:`show` returns the value only
when asked.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from streams.bounded import close_within
from streams.config import Settings
from streams.errors import DeadLetterReadError, InvalidEventError, JsonValueError, RedriveRefusedError, error_summary
from streams.kafka_security import client_kwargs, new_producer
from streams.ledger import redrives
from streams.ledger.redrives import Redrive, ValueSource
from streams.wire import contracts, exactjson, jsontext

log = logging.getLogger(__name__)

#: The schema name of the submissions topic (unprefixed), as :func:`streams.wire.contracts.decode` knows it.
SUBMISSIONS_SCHEMA = "generation.submissions"

#: Records fetched per partition and round while scanning.
FETCH_MAX_RECORDS = 500


def parse_record(text: str) -> tuple[int, int]:
    """``PARTITION:OFFSET`` (e.g. ``3:1207``) as ``(partition, offset)``.

    Raises:
        ValueError: not two non-negative integers separated by a colon.
    """
    part, sep, off = text.strip().partition(":")
    if not sep or not part.isdigit() or not off.isdigit():
        raise ValueError(f"{text!r} is not a dead letter's PARTITION:OFFSET, e.g. 3:1207")
    return int(part), int(off)


@dataclass(frozen=True)
class DeadLetter:
    """One record of the dead-letter topic: its place (partition, offset), Kafka timestamp (ms) and envelope."""

    partition: int
    offset: int
    timestamp_ms: int
    envelope: dict[str, Any]

    @property
    def record(self) -> str:
        """``PARTITION:OFFSET`` in the dead-letter topic."""
        return f"{self.partition}:{self.offset}"

    @property
    def reason(self) -> str:
        return str(self.envelope.get("reason", "?"))

    def original(self) -> bytes:
        """The original value, base64-decoded (cut at 512 KiB when ``original_truncated``); empty when the
        envelope's base64 does not decode."""
        try:
            return base64.b64decode(str(self.envelope.get("original_base64", "")), validate=True)
        except (binascii.Error, ValueError):
            return b""

    def key(self) -> str | None:
        """The original record key as text (UTF-8, undecodable bytes replaced), or None."""
        raw = self.envelope.get("key_base64")
        if not isinstance(raw, str):
            return None
        try:
            return base64.b64decode(raw, validate=True).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            return None

    def operation_id(self) -> str | None:
        """The operation id the original value names (its ``operation_id`` member), else the record key."""
        try:
            value = exactjson.loads(self.original())
        except (JsonValueError, ValueError, UnicodeDecodeError):
            value = None
        if isinstance(value, dict) and isinstance(value.get("operation_id"), str):
            return str(value["operation_id"])
        return self.key()

    def age_s(self, now_ms: int) -> float:
        """Seconds since the worker dead-lettered it (``failed_at_ms``; the Kafka timestamp when missing)."""
        failed = self.envelope.get("failed_at_ms")
        at_ms = failed if isinstance(failed, int) else self.timestamp_ms
        return max(now_ms - at_ms, 0) / 1000.0

    def summary(self, now_ms: int) -> dict[str, Any]:
        """What ``list`` shows of it: no payload (the error's text names fields and kinds, never content)."""
        env = self.envelope
        return {
            "record": self.record,
            "partition": self.partition,
            "offset": self.offset,
            "reason": self.reason,
            "age_s": self.age_s(now_ms),
            "failed_at_ms": env.get("failed_at_ms"),
            "operation_id": self.operation_id(),
            "source": f"{env.get('source_topic')}[{env.get('partition')}]@{env.get('offset')}",
            "original_size": env.get("original_size"),
            "original_truncated": env.get("original_truncated"),
            "error": env.get("error"),
            "worker": env.get("worker"),
        }


@dataclass(frozen=True)
class Filter:
    """Which dead letters: those at ``records`` ((partition, offset); empty: any), with a reason in ``reasons``
    (empty: any) and naming an operation in ``operation_ids`` (empty: any); all given conditions hold."""

    records: frozenset[tuple[int, int]] = frozenset()
    reasons: frozenset[str] = frozenset()
    operation_ids: frozenset[str] = frozenset()

    def matches(self, letter: DeadLetter) -> bool:
        if self.records and (letter.partition, letter.offset) not in self.records:
            return False
        if self.reasons and letter.reason not in self.reasons:
            return False
        return not self.operation_ids or letter.operation_id() in self.operation_ids

    @property
    def empty(self) -> bool:
        return not (self.records or self.reasons or self.operation_ids)


@dataclass
class Scan:
    """A bounded read of the dead-letter topic: the matching ``letters`` (oldest offset first per partition),
    how many records were read, the records the topic retains, and why it stopped early (``stopped``: None when
    every partition was read to its end offset, else ``limit`` or ``time budget``)."""

    topic: str
    letters: list[DeadLetter] = field(default_factory=list)
    read: int = 0
    retained: int = 0
    stopped: str | None = None


async def scan(settings: Settings, selection: Filter, *, limit: int, timeout_s: float) -> Scan:
    """Read the dead-letter topic from its first retained offset (from the lowest offset named, when the filter
    names records) up to its end offsets when the scan began, keeping at most ``limit`` (>= 1) matching records,
    within ``timeout_s`` seconds. A record that is not JSON is kept with an envelope ``{"reason": "?"}``.

    Raises:
        DeadLetterReadError: Kafka did not answer within ``timeout_s``, or the topic does not exist.
    """
    topic = settings.topic("dead_letter")
    result = Scan(topic)
    timeout_ms = max(int(timeout_s * 1000), 1000)
    consumer = AIOKafkaConsumer(
        **client_kwargs(settings),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=timeout_ms,
        max_partition_fetch_bytes=1024 * 1024,
    )
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            await _scan(consumer, settings, timeout_ms, topic, selection, limit, deadline, result)
    except TimeoutError:
        if result.read == 0 and not result.letters and result.retained == 0:
            raise DeadLetterReadError(f"Kafka did not answer within {timeout_s} s reading {topic}") from None
        result.stopped = "time budget"
    except (KafkaError, OSError) as exc:
        raise DeadLetterReadError(f"reading {topic}: {error_summary(exc)}") from exc
    finally:
        await close_within(consumer.stop(), timeout_s, "the dead-letter scan's Kafka consumer")
    return result


async def _scan(
    consumer: AIOKafkaConsumer,
    settings: Settings,
    timeout_ms: int,
    topic: str,
    selection: Filter,
    limit: int,
    deadline: float,
    result: Scan,
) -> None:
    partitions = await _partitions(consumer, settings, topic, timeout_ms)
    tps = [TopicPartition(topic, p) for p in partitions]
    consumer.assign(tps)
    first = await consumer.beginning_offsets(tps)
    end = await consumer.end_offsets(tps)
    result.retained = sum(end[tp] - first[tp] for tp in tps)
    wanted = {tp: first[tp] for tp in tps if end[tp] > first[tp]}
    if selection.records:
        named: dict[int, list[int]] = {}
        for p, o in selection.records:
            named.setdefault(p, []).append(o)
        wanted = {
            tp: max(min(named[tp.partition]), first[tp])
            for tp in tps
            if tp.partition in named and min(named[tp.partition]) < end[tp]
        }
        # stop a partition past the highest offset named
        end = {tp: min(end[tp], max(named[tp.partition]) + 1) for tp in wanted}
    for tp, offset in wanted.items():
        consumer.seek(tp, offset)
    remaining = set(wanted)
    loop = asyncio.get_running_loop()
    while remaining:
        wait_ms = int(min(max(deadline - loop.time(), 0.0), 1.0) * 1000)
        batch = await consumer.getmany(*remaining, timeout_ms=wait_ms, max_records=FETCH_MAX_RECORDS)
        for tp, messages in batch.items():
            for m in messages:
                if m.offset >= end[tp]:
                    remaining.discard(tp)
                    break
                result.read += 1
                letter = _letter(m.partition, m.offset, m.timestamp, m.value)
                if selection.matches(letter):
                    result.letters.append(letter)
                    if len(result.letters) >= limit:
                        result.stopped = "limit" if _more_to_read(tp, m.offset, end, remaining) else None
                        return
        for tp in list(remaining):
            if await consumer.position(tp) >= end[tp]:
                remaining.discard(tp)
        if remaining and loop.time() >= deadline:
            result.stopped = "time budget"
            return


async def _partitions(consumer: AIOKafkaConsumer, settings: Settings, topic: str, timeout_ms: int) -> list[int]:
    """The partitions of ``topic``, asked of the admin API (listed first: a metadata request naming a missing
    topic may have the broker create it); starts ``consumer``.

    Raises:
        DeadLetterReadError: the topic does not exist.
    """
    admin = AIOKafkaAdminClient(**client_kwargs(settings), request_timeout_ms=timeout_ms)
    try:
        await admin.start()
        if topic not in await admin.list_topics():
            raise DeadLetterReadError(f"topic {topic} does not exist: run streams migrate")
        (described,) = await admin.describe_topics([topic])
    finally:
        await close_within(admin.close(), timeout_ms / 1000, "the dead-letter scan's Kafka admin client")
    await consumer.start()
    return sorted(p["partition"] for p in described["partitions"])


def _more_to_read(tp: TopicPartition, offset: int, end: dict[TopicPartition, int], remaining: set[Any]) -> bool:
    return offset + 1 < end[tp] or len(remaining - {tp}) > 0


def _letter(partition: int, offset: int, timestamp_ms: int, value: bytes | None) -> DeadLetter:
    try:
        envelope = exactjson.loads(value or b"")
    except (JsonValueError, ValueError, UnicodeDecodeError):
        envelope = None
    if not isinstance(envelope, dict):
        envelope = {"reason": "?", "error": "the dead-letter record is not a JSON object"}
    return DeadLetter(partition, offset, timestamp_ms, envelope)


def now_ms() -> int:
    """The current epoch time in milliseconds (ages of dead letters)."""
    return int(time.time() * 1000)


def detail(letter: DeadLetter, *, show_payload: bool, redrives_done: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``show`` of one dead letter: its summary, the envelope's digest fields, the original key, the re-drives
    recorded, and the original value (``payload``: UTF-8 text, undecodable bytes replaced) only when
    ``show_payload``, else None."""
    env = letter.envelope
    out = {
        **letter.summary(now_ms()),
        "topic_timestamp_ms": letter.timestamp_ms,
        "key": letter.key(),
        "original_sha256": env.get("original_sha256"),
        "redrives": list(redrives_done),
        "payload": None,
    }
    if show_payload:
        out["payload"] = letter.original().decode("utf-8", "replace")
    return out


@dataclass(frozen=True)
class RedriveResult:
    """What became of one selected dead letter: ``published`` (topic, partition, offset) and the record's id, or
    ``refused`` (why; nothing published). ``dry_run``: checked, not published."""

    letter: DeadLetter
    operation_id: str | None
    value_source: ValueSource
    refused: str | None = None
    published: tuple[str, int, int] | None = None
    redrive_id: int | None = None


def check_redrive(
    settings: Settings,
    letter: DeadLetter,
    value: bytes,
    value_source: ValueSource,
    ledger_request: str | None,
    former_posts: int = 0,
) -> tuple[str, str | None]:
    """Whether ``value`` may be re-driven for ``letter``: ``(operation_id, None)``, or ``(operation_id or "",
    why not)``. ``ledger_request`` is the request the ledger holds for the value's operation (None: not held);
    ``former_posts`` the POSTs the accounting recorded for its id. Pure (no I/O): the rules of the module docstring."""
    if letter.envelope.get("source_topic") != settings.topic("submissions"):
        return "", (
            f"it came from {letter.envelope.get('source_topic')!r}, not {settings.topic('submissions')!r}: only "
            "submissions are re-driven (the other topics' events are the workers' own)"
        )
    if value_source == "original" and letter.envelope.get("original_truncated"):
        return "", "its original was cut at 512 KiB: give the whole (fixed) value with --value-file"
    try:
        event = contracts.decode(SUBMISSIONS_SCHEMA, value, settings.max_value_bytes)
    except InvalidEventError as exc:
        return "", f"the {value_source} value is still invalid ({exc.reason}: {exc}); fix it and give --value-file"
    operation_id = str(event["operation_id"])
    if ledger_request is not None:
        try:
            held = jsontext.canonical(exactjson.loads(ledger_request))
        except JsonValueError:
            held = None
        if held != jsontext.canonical(event["request"]):
            return operation_id, (
                f"the ledger holds operation {operation_id} with another request (canonical forms differ, or it "
                "was erased): a different request needs a new operation id"
            )
    elif former_posts or (letter.reason == "conflicting_duplicate" and operation_id == letter.operation_id()):
        was = (
            f"the provider was asked for operation {operation_id} before ({former_posts} POST attempts in the "
            "accounting)"
            if former_posts
            else f"it was refused as a duplicate of operation {operation_id}"
        )
        return operation_id, (
            f"{was}, and the ledger no longer holds it (streams purge --ids-older-than freed its id): re-driving it "
            "would run it again as a new operation; give it a new operation id with --value-file if that is meant"
        )
    return operation_id, None


def value_operation_id(settings: Settings, value: bytes) -> str | None:
    """The operation id of a submission value, or None when it does not decode as one."""
    try:
        return str(contracts.decode(SUBMISSIONS_SCHEMA, value, settings.max_value_bytes)["operation_id"])
    except InvalidEventError:
        return None


async def redrive(
    settings: Settings,
    pool: asyncpg.Pool,
    letters: Iterable[DeadLetter],
    *,
    fixed_value: bytes | None,
    why: str,
    actor: str,
    dry_run: bool,
    timeout_s: float,
) -> list[RedriveResult]:
    """Re-drive each of ``letters`` (:func:`check_redrive` first): publish the value (``fixed_value``, else the
    dead letter's original) to the submissions topic keyed by its operation id, wait for the broker's ack, then
    record it in the ledger. ``dry_run`` checks and publishes nothing.

    Raises:
        RedriveRefusedError: ``why`` or ``actor`` is empty, or ``fixed_value`` is given for more than one letter.
        DeadLetterReadError: Kafka refused or did not acknowledge a publish within ``timeout_s`` (the letters
            published before are recorded).
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    chosen = list(letters)
    if not why.strip() or not actor.strip():
        raise RedriveRefusedError("a re-drive needs a reason (--why) and an actor; nothing was published")
    if fixed_value is not None and len(chosen) != 1:
        raise RedriveRefusedError(
            f"--value-file fixes one dead letter, and {len(chosen)} are selected: select exactly one"
        )
    source: ValueSource = "file" if fixed_value is not None else "original"
    producer: AIOKafkaProducer | None = None
    results: list[RedriveResult] = []
    try:
        for letter in chosen:
            value = fixed_value if fixed_value is not None else letter.original()
            candidate = value_operation_id(settings, value)
            held = await redrives.operation_request(pool, candidate) if candidate is not None else None
            posts = await redrives.posts_of(pool, candidate) if candidate is not None and held is None else 0
            operation_id, refused = check_redrive(settings, letter, value, source, held, posts)
            if refused is not None or dry_run:
                results.append(RedriveResult(letter, operation_id or letter.operation_id(), source, refused))
                continue
            target = settings.topic("submissions")
            try:
                if producer is None:
                    producer = new_producer(settings, request_timeout_ms=int(timeout_s * 1000))
                    async with asyncio.timeout(timeout_s):
                        await producer.start()
                async with asyncio.timeout(timeout_s):
                    meta = await producer.send_and_wait(target, value, key=operation_id.encode())
            except (KafkaError, TimeoutError) as exc:
                raise DeadLetterReadError(
                    f"publishing dead letter {letter.record} to {target}: {error_summary(exc)}; "
                    f"{len(results)} handled before it"
                ) from exc
            record = await redrives.record_redrive(
                pool,
                Redrive(
                    dead_letter_topic=settings.topic("dead_letter"),
                    dead_letter_partition=letter.partition,
                    dead_letter_offset=letter.offset,
                    dead_letter_reason=letter.reason,
                    operation_id=operation_id,
                    target_topic=target,
                    target_partition=meta.partition,
                    target_offset=meta.offset,
                    value_source=source,
                    value_sha256=hashlib.sha256(value).hexdigest(),
                    why=why,
                    actor=actor,
                ),
            )
            log.info(
                "re-drove dead letter %s (%s) of operation %s to %s[%d]@%d, %s value, by %s",
                letter.record,
                letter.reason,
                operation_id,
                target,
                meta.partition,
                meta.offset,
                source,
                actor,
            )
            results.append(
                RedriveResult(letter, operation_id, source, None, (target, meta.partition, meta.offset), record["id"])
            )
    finally:
        if producer is not None:  # a record left unacknowledged is given up with the command
            await close_within(producer.stop(), timeout_s, "the re-drive's Kafka producer")
    return results
