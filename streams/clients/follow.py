"""Downstream helper: follow ``generation.outputs.delivered`` and yield each output exactly once.

The relay may repeat an event after a crash (same ``event_id``); :class:`EventDeduplicator` drops repeats, and a run
that resumes a consumer group's offsets learns the event ids just before them (:func:`follow_outputs`).
Values are read with :func:`streams.wire.exactjson.loads`: an output's numbers reach the reader exactly (a 2**64 stays
an ``int``, a long fraction a ``Decimal``).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition
from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_fixed

from streams.config import Settings
from streams.kafka_security import client_kwargs, raise_for_security
from streams.wire import exactjson

#: Records of each partition read again before a group's committed offset when ``follow_outputs`` resumes, only to
#: learn their event ids: a repeat the relay published within them is recognised (the relay repeats a record it
#: published but could not mark, in its next round: seconds, a few hundred records at most).
RESUME_LOOKBACK_RECORDS = 10_000

#: Most seconds between two commits of the offsets ``follow_outputs`` handled, with a group.
COMMIT_INTERVAL_S = 1.0

#: How long a consumer without a group is given to be assigned its topic's partitions, and how often it is looked
#: at meanwhile (s).
ASSIGNMENT_TIMEOUT_S = 10.0
ASSIGNMENT_LOOK_INTERVAL_S = 0.05


class EventDeduplicator:
    """Remembers the last ``capacity`` event ids; :meth:`first_time` is True once per id."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.duplicates = 0

    def first_time(self, event_id: str) -> bool:
        """True the first time ``event_id`` is seen (within the capacity window), False for a repeat."""
        if event_id in self._seen:
            self.duplicates += 1
            return False
        self._seen[event_id] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return True


@dataclass(frozen=True)
class DeliveredRecord:
    """One record read from a topic: the decoded value (numbers exact), its bytes and Kafka timestamp (epoch ms)."""

    value: dict[str, Any]
    timestamp_ms: int
    partition: int
    offset: int
    raw: bytes


async def read_topic_to_end(settings: Settings, role: str) -> list[DeliveredRecord]:
    """Read the whole topic of ``role`` from the beginning up to its current end offsets (no consumer group)."""
    topic = settings.topic(role)
    # Without a group id a subscribing consumer is assigned every partition of the topic, no coordinator.
    consumer = AIOKafkaConsumer(
        topic, **client_kwargs(settings), enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await _start(settings, consumer)
    try:
        tps = sorted(await _assignment(consumer))
        if not tps:
            return []
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        out: list[DeliveredRecord] = []
        remaining = {tp for tp in tps if end[tp] > 0}
        while remaining:
            batch = await consumer.getmany(*remaining, timeout_ms=1000)
            for tp, msgs in batch.items():
                for m in msgs:
                    if m.offset < end[tp]:
                        out.append(
                            DeliveredRecord(exactjson.loads(m.value), m.timestamp, tp.partition, m.offset, m.value)
                        )
                    if m.offset >= end[tp] - 1:
                        remaining.discard(tp)
            for tp in list(remaining):
                if await consumer.position(tp) >= end[tp]:
                    remaining.discard(tp)
        return out
    finally:
        await consumer.stop()


async def _start(settings: Settings, consumer: AIOKafkaConsumer) -> None:
    """Start ``consumer``. Raises :class:`~streams.errors.KafkaSecurityError` for a wrong security setting of
    ``settings``; aiokafka's other errors pass through."""
    try:
        await consumer.start()
    except Exception as exc:
        await consumer.stop()  # a consumer that did not start still holds its client
        await raise_for_security(settings, exc)
        raise


async def _assignment(consumer: AIOKafkaConsumer) -> set[TopicPartition]:
    """The partitions assigned to ``consumer`` once it has any: looked at every :data:`ASSIGNMENT_LOOK_INTERVAL_S`
    (tenacity), for :data:`ASSIGNMENT_TIMEOUT_S` at most (then the empty set: the topic has no partition)."""

    async def assigned() -> set[TopicPartition]:
        return set(consumer.assignment())

    retrying = AsyncRetrying(
        retry=retry_if_result(lambda partitions: not partitions),
        wait=wait_fixed(ASSIGNMENT_LOOK_INTERVAL_S),
        stop=stop_after_delay(ASSIGNMENT_TIMEOUT_S),
        retry_error_callback=lambda _: set(),
    )
    partitions: set[TopicPartition] = await retrying(assigned)
    return partitions


class _ResumeBehind(ConsumerRebalanceListener):  # type: ignore[misc]
    """On each assignment, moves every partition back :data:`RESUME_LOOKBACK_RECORDS` before its committed offset
    and notes that offset in ``resume_at``: the records before it were handled by an earlier run, and are read again
    only to learn their event ids."""

    def __init__(self, consumer: AIOKafkaConsumer, resume_at: dict[TopicPartition, int]) -> None:
        self.consumer = consumer
        self.resume_at = resume_at

    async def on_partitions_revoked(self, revoked: Any) -> None:
        for tp in revoked:
            self.resume_at.pop(tp, None)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        for tp in assigned:
            committed = await self.consumer.committed(tp)
            if committed:
                self.resume_at[tp] = committed
                beginning = (await self.consumer.beginning_offsets([tp]))[tp]
                self.consumer.seek(tp, max(beginning, committed - RESUME_LOOKBACK_RECORDS))


async def follow_outputs(
    settings: Settings, *, group_id: str | None = None, from_beginning: bool = True
) -> AsyncIterator[dict[str, Any]]:
    """Yield each delivered output once (deduplicated by ``event_id``), following the topic forever.

    With a ``group_id`` the consumer commits the offsets of the records handled (a value yielded counts as handled
    once the next one is asked for or the iteration stops), at most every :data:`COMMIT_INTERVAL_S` and when it
    stops: a restart resumes after them, never past a value not yet handled (one killed between handling and
    committing yields it again). The :data:`RESUME_LOOKBACK_RECORDS` records of each partition before the resume point
    are read again to learn their event ids, so a repeat published within them (the relay's, after a crash) is not
    yielded a second time by the next run either.
    """
    topic = settings.topic("outputs_delivered")
    consumer = AIOKafkaConsumer(
        **client_kwargs(settings),
        group_id=group_id,
        auto_offset_reset="earliest" if from_beginning else "latest",
        enable_auto_commit=False,
    )
    dedupe = EventDeduplicator()
    resume_at: dict[TopicPartition, int] = {}
    handled: dict[TopicPartition, int] = {}
    if group_id is not None:
        consumer.subscribe([topic], listener=_ResumeBehind(consumer, resume_at))
    else:
        consumer.subscribe([topic])
    await _start(settings, consumer)
    committed_at = time.monotonic()
    try:
        async for message in consumer:
            tp = TopicPartition(message.topic, message.partition)
            value = exactjson.loads(message.value)
            fresh = dedupe.first_time(value["event_id"])
            if fresh and message.offset >= resume_at.get(tp, 0):
                try:
                    yield value
                except GeneratorExit:  # the caller stopped after taking it: handled
                    handled[tp] = message.offset + 1
                    raise
            handled[tp] = message.offset + 1
            if group_id is not None and time.monotonic() - committed_at >= COMMIT_INTERVAL_S:
                await _commit(consumer, handled, resume_at)
                committed_at = time.monotonic()
    finally:
        if group_id is not None:
            with contextlib.suppress(KafkaError):
                await _commit(consumer, handled, resume_at)
        await consumer.stop()


async def _commit(
    consumer: AIOKafkaConsumer, handled: dict[TopicPartition, int], resume_at: dict[TopicPartition, int]
) -> None:
    """Commit ``handled`` (partition -> next offset) for the partitions still assigned, never below a partition's
    resume point (the look-back's records were handled before); then forget them."""
    assigned = consumer.assignment()
    offsets = {tp: max(offset, resume_at.get(tp, 0)) for tp, offset in handled.items() if tp in assigned}
    handled.clear()
    if offsets:
        await consumer.commit(offsets)
