"""Downstream helper: follow ``generation.outputs.delivered`` and yield each output exactly once.

The relay may repeat an event after a crash (same ``event_id``); :class:`EventDeduplicator` drops repeats, and a run
that resumes a consumer group's offsets learns the event ids just before them (:func:`follow_outputs`).
Values are read with :func:`streams.wire.exactjson.loads`: an output's numbers reach the reader exactly (a 2**64 stays
an ``int``, a long fraction a ``Decimal``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import TopicPartition
from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_fixed

from streams.bounded import close_within
from streams.config import Settings
from streams.errors import JsonValueError, error_summary
from streams.kafka_security import client_kwargs, raise_for_security
from streams.wire import exactjson

log = logging.getLogger(__name__)

#: Records of each partition read again before a group's committed offset when ``follow_outputs`` resumes, only to
#: learn their event ids: a repeat the relay published within them is recognised (the relay repeats a record it
#: published but could not mark, in its next round: seconds, a few hundred records at most).
RESUME_LOOKBACK_RECORDS = 10_000

#: Most seconds the look-back of an assignment may take (its partitions' records wait for it; then they are handled
#: without it).
LOOKBACK_TIMEOUT_S = 10.0

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


class _LearnBeforeResuming(ConsumerRebalanceListener):  # type: ignore[misc]
    """On each assignment, starts reading the :data:`RESUME_LOOKBACK_RECORDS` records of every partition before its
    committed offset, all with one consumer of its own (no group), only to learn their event ids
    (:func:`learn_event_ids`): an earlier run handled them. The reading runs in a task of its own (the group's
    heartbeats wait while a listener runs), within :data:`LOOKBACK_TIMEOUT_S`; a partition's records are handled
    once its look-back ended, read or not. On each revocation, stops the look-backs and commits what was handled of
    the partitions while they are still ours."""

    def __init__(
        self,
        settings: Settings,
        consumer: AIOKafkaConsumer,
        dedupe: EventDeduplicator,
        handled: dict[TopicPartition, int],
    ) -> None:
        self.settings = settings
        self.consumer = consumer
        self.dedupe = dedupe
        self.handled = handled
        #: Set once a partition's look-back ended: its records are handled only then.
        self.learned: dict[TopicPartition, asyncio.Event] = {}
        self._lookbacks: set[asyncio.Task[None]] = set()

    async def on_partitions_revoked(self, revoked: Any) -> None:
        self.stop()
        with contextlib.suppress(KafkaError):
            await _commit(self.consumer, self.handled)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        events = {tp: asyncio.Event() for tp in assigned}
        self.learned.update(events)  # before any await: no record of these partitions is handled until set
        if events:
            task = asyncio.create_task(self._look_back(events))
            self._lookbacks.add(task)
            task.add_done_callback(self._lookbacks.discard)

    def stop(self) -> None:
        """Cancel the look-backs under way; their partitions' records are then handled without them (a task cancelled
        before it ran never reaches its ``finally``: every event is set here too)."""
        for task in list(self._lookbacks):
            task.cancel()
        for learned in self.learned.values():
            learned.set()

    async def _look_back(self, events: dict[TopicPartition, asyncio.Event]) -> None:
        try:
            async with asyncio.timeout(LOOKBACK_TIMEOUT_S):
                before = {}
                for tp, learned in events.items():
                    committed = await self.consumer.committed(tp)
                    if committed:
                        before[tp] = committed
                    else:
                        learned.set()  # nothing handled before: nothing to learn
                if before:
                    await learn_event_ids(self.settings, before, self.dedupe, lambda tp: events[tp].set())
        except Exception as exc:  # the look-back only helps: without it, the in-memory dedupe alone
            waiting = sorted(f"{tp.topic}[{tp.partition}]" for tp, learned in events.items() if not learned.is_set())
            log.warning("event ids before the committed offsets of %s not read (%s)", waiting, error_summary(exc))
        finally:
            for learned in events.values():
                learned.set()


async def learn_event_ids(
    settings: Settings,
    before: Mapping[TopicPartition, int],
    dedupe: EventDeduplicator,
    on_learned: Callable[[TopicPartition], None] | None = None,
) -> dict[TopicPartition, int]:
    """Read, with one consumer of its own, the records of each partition of ``before`` from
    :data:`RESUME_LOOKBACK_RECORDS` before its offset (or the partition's first) up to it, each one's event id told to
    ``dedupe`` as seen (a record that is not an output event is skipped); ``on_learned(tp)`` is called as each
    partition is done. Returns how many records of each partition were read: none of a partition that ends before its
    offset (the topic was made again: its records are new to the group). Unbounded in time on a partition that stops
    answering: the caller bounds it."""
    read = dict.fromkeys(before, 0)
    done = on_learned or (lambda tp: None)
    reader = AIOKafkaConsumer(**client_kwargs(settings), enable_auto_commit=False)
    await _start(settings, reader)
    try:
        tps = list(before)
        beginnings, ends = await reader.beginning_offsets(tps), await reader.end_offsets(tps)
        pending = {tp: offset for tp, offset in before.items() if beginnings[tp] < offset <= ends[tp]}
        for tp in before.keys() - pending.keys():
            done(tp)
        reader.assign(list(pending))
        for tp, offset in pending.items():
            reader.seek(tp, max(beginnings[tp], offset - RESUME_LOOKBACK_RECORDS))
        while pending:
            for tp, messages in (await reader.getmany(*pending, timeout_ms=1000)).items():
                for message in messages:
                    if tp not in pending or message.offset >= pending[tp]:
                        continue
                    try:
                        dedupe.first_time(exactjson.loads(message.value)["event_id"])
                    except (JsonValueError, KeyError, TypeError):
                        continue
                    read[tp] += 1
            for tp in list(pending):
                if await reader.position(tp) >= pending[tp]:
                    del pending[tp]
                    reader.pause(tp)
                    done(tp)
        return read
    finally:
        await reader.stop()


async def follow_outputs(
    settings: Settings, *, group_id: str | None = None, from_beginning: bool = True
) -> AsyncGenerator[dict[str, Any], None]:
    """Yield each delivered output once (deduplicated by ``event_id``), following the topic forever.

    With a ``group_id`` the consumer commits the offsets of the records handled (a value yielded counts as handled
    once the next one is asked for or the iteration stops: close the generator, ``contextlib.aclosing``), at most
    every :data:`COMMIT_INTERVAL_S`, when a partition is revoked and when it stops: a restart resumes after them,
    never past a value not yet handled (one killed between handling and committing yields it again; so does the next
    owner of a partition revoked while a value of it waited to be handled). Outputs the caller skips count as
    handled. On resuming, the :data:`RESUME_LOOKBACK_RECORDS` records of each partition before its committed offset
    are read to learn their event ids (within :data:`LOOKBACK_TIMEOUT_S`), so a repeat published after them (the
    relay's, after a crash) is not yielded a second time either.
    """
    topic = settings.topic("outputs_delivered")
    consumer = AIOKafkaConsumer(
        **client_kwargs(settings),
        group_id=group_id,
        auto_offset_reset="earliest" if from_beginning else "latest",
        enable_auto_commit=False,
    )
    dedupe = EventDeduplicator()
    handled: dict[TopicPartition, int] = {}
    listener = _LearnBeforeResuming(settings, consumer, dedupe, handled)
    if group_id is not None:
        consumer.subscribe([topic], listener=listener)
    else:
        consumer.subscribe([topic])
    await _start(settings, consumer)
    committed_at = time.monotonic()
    try:
        async for message in consumer:
            tp = TopicPartition(message.topic, message.partition)
            learned = listener.learned.get(tp)
            if learned is not None:
                await learned.wait()
            value = exactjson.loads(message.value)
            if dedupe.first_time(value["event_id"]):
                try:
                    yield value
                except GeneratorExit:  # the caller stopped after taking it: handled
                    handled[tp] = message.offset + 1
                    raise
            handled[tp] = message.offset + 1
            if group_id is not None and time.monotonic() - committed_at >= COMMIT_INTERVAL_S:
                try:
                    await _commit(consumer, handled)
                except (CommitFailedError, IllegalStateError) as exc:  # a rebalance under way: the next one commits
                    log.info("offsets not committed yet (%s); kept for the next commit", type(exc).__name__)
                committed_at = time.monotonic()
    finally:
        listener.stop()
        limit_s = settings.kafka_request_timeout_s  # a stop (Ctrl-C) with Kafka frozen ends within this, twice
        if group_id is not None:
            try:
                async with asyncio.timeout(limit_s):
                    await _commit(consumer, handled)
            except (KafkaError, TimeoutError) as exc:
                why = f"no answer within {limit_s:g} s" if isinstance(exc, TimeoutError) else error_summary(exc)
                log.warning(
                    "the last offsets were not committed (%s): a restart of group %s prints again what came after "
                    "its last commit",
                    why,
                    group_id,
                )
        await close_within(consumer.stop(), limit_s, "the follower's Kafka consumer")


async def _commit(consumer: AIOKafkaConsumer, handled: dict[TopicPartition, int]) -> None:
    """Commit ``handled`` (partition -> next offset) for the partitions still assigned; then forget them (those of
    partitions no longer assigned too: their new owner resumes from the last commit)."""
    assigned = consumer.assignment()
    offsets = {tp: offset for tp, offset in handled.items() if tp in assigned}
    if offsets:
        await consumer.commit(offsets)  # raising, keeps them in handled for the next commit
    handled.clear()
