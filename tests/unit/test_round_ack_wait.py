"""A Kafka partition that stops acknowledging (its records neither acknowledged nor failed) holds up the outbox
relay's and the poll scheduler's rounds at most ``kafka_round_ack_wait_s``: the healthy partitions' records are
marked within it, the stuck ones are neither marked nor sent again while in flight, then marked once acknowledged
(or sent again once failed by the delivery timeout)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiokafka.errors
import httpx
import pytest
from prometheus_client import REGISTRY

from streams.config import Settings
from streams.errors import ConfigError
from streams.model.states import OperationState as S
from streams.wire import exactjson
from streams.worker.partitions import BLOCKED_SKIP_S, PartitionRoutes
from streams.worker.runtime import Record, Runtime, delivery_error
from streams.worker.stages.relay import OutboxRelay
from streams.worker.stages.scheduler import PollScheduler
from streams.worker.wakeup import ACKED
from tests.fakes import InMemoryLedger, Operation, OutboxRow, fake_runtime

PARTITIONS = 3
#: Operation ids by the partition the test's partitioner maps them to (the last character's digit, mod 3).
HEALTHY_A, STUCK, HEALTHY_C = "op-0", "op-1", "op-2"
#: The round's wait in these tests (s); the tests never wait on the clock beyond it.
ROUND_ACK_WAIT_S = 0.2
#: Longest a round may take before the test calls it stuck (s): far above the wait, far below "for ever".
ROUND_GUARD_S = 10.0


def partition_of(topic: str, key: bytes) -> int:
    return int(key.decode()[-1]) % PARTITIONS


@dataclass
class StuckEnqueue:
    """The runtime's ``enqueue`` (an :data:`~streams.worker.runtime.EnqueueFn`, as aiokafka's ``send``): every record
    is acknowledged at once but those for a partition in ``stuck``, whose acknowledgements stay pending until
    :meth:`answer`. ``handed`` keeps every record handed over, in order."""

    stuck: set[int] = field(default_factory=lambda: {partition_of("", STUCK.encode())})
    handed: list[Record] = field(default_factory=list)
    pending: list[asyncio.Future[Any]] = field(default_factory=list)

    async def __call__(self, topic: str, key: bytes, value: bytes) -> asyncio.Future[Any]:
        self.handed.append((topic, key, value))
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if partition_of(topic, key) in self.stuck:
            self.pending.append(ack)
        else:
            ack.set_result(None)
        return ack

    async def answer(self, error: BaseException | None = None) -> None:
        """The stuck partition answers every pending record (acknowledged, or failed with ``error``) and acknowledges
        at once from now; returns once their callbacks ran."""
        self.stuck.clear()
        for ack in self.pending:
            if error is None:
                ack.set_result(None)
            else:
                ack.set_exception(error)
        self.pending.clear()
        await asyncio.sleep(0)  # the done callbacks run on the next turn of the loop

    def handed_rows(self, operation_id: str) -> list[int]:
        return [exactjson.loads(v)["n"] for _, k, v in self.handed if k == operation_id.encode()]


@dataclass
class Clock:
    t: float = 1000.0

    def __call__(self) -> float:
        return self.t


def runtime(settings: Settings, ledger: InMemoryLedger, enqueue: StuckEnqueue, clock: Clock) -> Runtime:
    rt = fake_runtime(settings.replace(kafka_round_ack_wait_s=ROUND_ACK_WAIT_S), lambda r: httpx.Response(500), ledger)
    rt.enqueue = enqueue
    rt.routes = PartitionRoutes(partition_of, clock=clock)
    return rt


def skips(what: str, topic: str, partition: int) -> float:
    labels = {"what": what, "topic": topic, "partition": str(partition)}
    return REGISTRY.get_sample_value("streams_kafka_blocked_skips_total", labels) or 0.0


def add_rows(ledger: InMemoryLedger, *operation_ids: str) -> None:
    for operation_id in operation_ids:
        row_id = len(ledger.outbox) + 1
        payload = {"operation_id": operation_id, "n": row_id}
        ledger.outbox.append(OutboxRow(row_id, f"ev-{row_id}", "transitions", operation_id, None, payload))


def published(ledger: InMemoryLedger, operation_id: str | None = None) -> list[int]:
    return [r.id for r in ledger.outbox if r.published and operation_id in (None, r.operation_id)]


async def tick(relay: OutboxRelay) -> int:
    return await asyncio.wait_for(relay.tick(), ROUND_GUARD_S)


async def test_relay_marks_the_healthy_partitions_within_the_wait_and_the_stuck_one_once_acknowledged(
    base_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    ledger, enqueue, clock = InMemoryLedger(), StuckEnqueue(), Clock()
    relay = OutboxRelay(runtime(base_settings, ledger, enqueue, clock))
    topic = base_settings.topic("transitions")
    add_rows(ledger, HEALTHY_A, STUCK, HEALTHY_C, STUCK, HEALTHY_A)
    before = skips("outbox relay", topic, 1)
    caplog.set_level(logging.WARNING)

    assert await tick(relay) == 3  # the round ends at the wait: the healthy rows are marked
    assert published(ledger) == [1, 3, 5]
    assert enqueue.handed_rows(STUCK) == [2, 4]
    assert skips("outbox relay", topic, 1) == before + 2
    assert (
        "acknowledgements are overdue (in flight, not sent again), their partitions are skipped "
        f"(re-probed after {BLOCKED_SKIP_S:.0f} s" in caplog.text
    )
    assert f"{topic}[1] x2" in caplog.text
    assert relay.rt.routes.blocked(topic, STUCK.encode()) == (topic, 1)  # skipped by the next rounds

    add_rows(ledger, HEALTHY_A, STUCK)  # rows 6, 7
    assert await tick(relay) == 1
    assert published(ledger)[-1] == 6
    assert relay._skip_operation_ids() == [STUCK]
    clock.t += BLOCKED_SKIP_S  # the probe: rows 2 and 4 still in flight, so neither they nor row 7 go again
    assert await tick(relay) == 0
    assert enqueue.handed_rows(STUCK) == [2, 4]
    assert published(ledger, STUCK) == []

    await enqueue.answer()  # the late acknowledgements wake the relay
    assert relay.rt.wakeups.outbox._take() == ACKED
    assert await tick(relay) == 3
    assert published(ledger, STUCK) == [2, 4, 7]
    assert enqueue.handed_rows(STUCK) == [2, 4, 7]  # each sent once, in id order
    assert relay.sent == {}
    assert all(r.published for r in ledger.outbox)


async def test_relay_sends_a_row_again_once_its_late_answer_is_a_failure(base_settings: Settings) -> None:
    ledger, enqueue, clock = InMemoryLedger(), StuckEnqueue(), Clock()
    relay = OutboxRelay(runtime(base_settings, ledger, enqueue, clock))
    add_rows(ledger, STUCK, HEALTHY_C, STUCK)

    assert await tick(relay) == 1
    assert published(ledger) == [2]
    await enqueue.answer(aiokafka.errors.KafkaTimeoutError())  # the delivery timeout passed
    assert relay.sent == {}
    assert await tick(relay) == 0  # its partition is still skipped
    clock.t += BLOCKED_SKIP_S
    assert await tick(relay) == 2
    assert published(ledger, STUCK) == [1, 3]
    assert enqueue.handed_rows(STUCK) == [1, 3, 1, 3]  # sent again, in id order


async def test_relay_marks_a_later_row_acknowledged_in_time_only_after_the_earlier_one_in_flight(
    base_settings: Settings,
) -> None:
    ledger, clock = InMemoryLedger(), Clock()

    @dataclass
    class FirstStuck(StuckEnqueue):
        """Only outbox row 1's acknowledgement is pending; row 2 of the same operation is acknowledged at once."""

        async def __call__(self, topic: str, key: bytes, value: bytes) -> asyncio.Future[Any]:
            self.handed.append((topic, key, value))
            ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            if exactjson.loads(value)["n"] == 1 and self.stuck:
                self.pending.append(ack)
            else:
                ack.set_result(None)
            return ack

    enqueue = FirstStuck()
    relay = OutboxRelay(runtime(base_settings, ledger, enqueue, clock))
    add_rows(ledger, STUCK, STUCK)
    assert await tick(relay) == 0  # row 2 acknowledged, but not marked before row 1
    await enqueue.answer()
    assert await tick(relay) == 2
    assert published(ledger) == [1, 2]
    assert enqueue.handed_rows(STUCK) == [1, 2]  # neither sent again


async def test_relay_stops_handing_over_at_the_wait_when_a_stuck_partitions_batch_is_full(
    base_settings: Settings,
) -> None:
    ledger, clock = InMemoryLedger(), Clock()
    also_stuck = "op-4"  # another operation on the stuck partition

    @dataclass
    class FullBatch(StuckEnqueue):
        """The stuck partition takes one record, then its batch is full: handing over the next one waits (as
        aiokafka's ``add_message`` until the batch is sent) while ``stuck``."""

        async def __call__(self, topic: str, key: bytes, value: bytes) -> asyncio.Future[Any]:
            on_stuck = [r for r in self.handed if partition_of(r[0], r[1]) in self.stuck]
            if partition_of(topic, key) in self.stuck and on_stuck:
                await asyncio.Event().wait()  # cancelled at the round's wait: this record is not buffered
            return await super().__call__(topic, key, value)

    enqueue = FullBatch()
    relay = OutboxRelay(runtime(base_settings, ledger, enqueue, clock))
    topic = base_settings.topic("transitions")
    add_rows(ledger, HEALTHY_A, STUCK, also_stuck, HEALTHY_C, HEALTHY_A)

    assert await tick(relay) == 1  # the hand-over stopped at row 3: rows 4 and 5 were not sent
    assert published(ledger) == [1]
    assert enqueue.handed_rows(also_stuck) == [] and enqueue.handed_rows(HEALTHY_C) == []
    assert relay.rt.routes.blocked(topic, also_stuck.encode()) == (topic, 1)
    assert relay.rt.routes.blocked(topic, HEALTHY_C.encode()) is None  # not at fault: not skipped

    assert await tick(relay) == 2  # the stuck partition skipped: the others go
    assert published(ledger) == [1, 4, 5]
    assert enqueue.handed_rows(STUCK) == [2] and enqueue.handed_rows(also_stuck) == []


def pollable(ledger: InMemoryLedger, operation_id: str) -> None:
    now = ledger.now()
    ledger.operations[operation_id] = Operation(
        operation_id, "{}", 0, None, now, "w", state=S.RUNNING, remote_job_id=f"job-{operation_id}", next_poll_at=now
    )


async def test_scheduler_publishes_the_healthy_partitions_polls_within_the_wait_and_skips_the_stuck_one(
    base_settings: Settings,
) -> None:
    ledger, enqueue, clock = InMemoryLedger(), StuckEnqueue(), Clock()
    scheduler = PollScheduler(runtime(base_settings, ledger, enqueue, clock))
    rt = scheduler.rt
    topic = base_settings.topic("polls")
    for operation_id in (HEALTHY_A, STUCK, HEALTHY_C):
        pollable(ledger, operation_id)
    before = skips("poll scheduler", topic, 1)

    assert await asyncio.wait_for(scheduler.tick(), ROUND_GUARD_S) == 2
    assert sorted(k.decode() for _, k, _ in enqueue.handed) == [HEALTHY_A, STUCK, HEALTHY_C]
    assert skips("poll scheduler", topic, 1) == before + 1
    assert rt.routes.blocked(topic, STUCK.encode()) == (topic, 1)

    ledger.advance(base_settings.visibility_timeout_s)  # every claim returns
    assert await asyncio.wait_for(scheduler.tick(), ROUND_GUARD_S) == 2
    assert [k.decode() for _, k, _ in enqueue.handed].count(STUCK) == 1  # not sent again while skipped
    assert rt.routes.strikes == {(topic, 1): 1}
    await enqueue.answer()  # published late: its partition's next failure starts over
    assert rt.routes.strikes == {}


async def test_send_within_returns_at_the_wait_with_the_stuck_records_in_flight(base_settings: Settings) -> None:
    enqueue = StuckEnqueue()
    rt = runtime(base_settings, InMemoryLedger(), enqueue, Clock())
    records = [("t", op.encode(), b"{}") for op in (HEALTHY_A, STUCK, HEALTHY_C)]

    deliveries = await asyncio.wait_for(rt.send_within(records, ROUND_ACK_WAIT_S), ROUND_GUARD_S)

    assert [d.done() for d in deliveries] == [True, False, True]
    assert [delivery_error(d) for d in deliveries if d.done()] == [None, None]
    await enqueue.answer(aiokafka.errors.KafkaTimeoutError())
    assert isinstance(delivery_error(deliveries[1]), aiokafka.errors.KafkaTimeoutError)


def test_the_round_wait_must_be_shorter_than_the_delivery_timeout(base_settings: Settings) -> None:
    with pytest.raises(ConfigError, match=r"STREAMS_KAFKA_ROUND_ACK_WAIT_S \(30.0\) must be less than"):
        base_settings.replace(kafka_round_ack_wait_s=30.0, kafka_delivery_timeout_s=30.0)
    assert Settings.model_fields["kafka_round_ack_wait_s"].default == 3.0


async def test_relay_probes_before_a_round_unless_its_last_round_found_rows(base_settings: Settings) -> None:
    """A round after one that found nothing (or the lock held, or failed) first probes in one statement
    (``Ledger.relay_outbox(probe=True)``); a round after one that published rows opens its transaction at once."""
    ledger, enqueue, clock = InMemoryLedger(), StuckEnqueue(stuck=set()), Clock()
    relay = OutboxRelay(runtime(base_settings, ledger, enqueue, clock))
    assert await tick(relay) == 0  # nothing yet: probed
    add_rows(ledger, HEALTHY_A)
    assert await tick(relay) == 1  # after an empty round: probed
    add_rows(ledger, HEALTHY_C)
    assert await tick(relay) == 1  # the last round found rows: at once
    assert await tick(relay) == 0  # so did that one: at once, finding nothing; the next one probes again
    assert ledger.relay_probes == [True, True, False, False]
    assert await tick(relay) == 0
    assert ledger.relay_probes[-1] is True


@dataclass
class RefusingEnqueue(StuckEnqueue):
    """Refuses for good (record too large) the records whose payload says ``big``; acknowledges the others."""

    async def __call__(self, topic: str, key: bytes, value: bytes) -> asyncio.Future[Any]:
        self.handed.append((topic, key, value))
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if exactjson.loads(value).get("big"):
            ack.set_exception(aiokafka.errors.MessageSizeTooLargeError())
        else:
            ack.set_result(None)
        return ack


async def test_a_dead_letter_that_does_not_go_within_the_wait_leaves_its_row_and_its_operations_later_rows(
    base_settings: Settings,
) -> None:
    """Rows refused for good are dead-lettered inside the round, which holds the relay lock and its transaction:
    a dead-letter topic that does not acknowledge (``dead_letter`` waits out outages) held them for good. Now the
    round's dead letters together wait at most ``kafka_round_ack_wait_s``; a row whose dead letter did not go and
    the later rows of its operation (dead-lettered or not) stay unmarked and unsent for a round
    ``relay_interval_s`` later, the other operations' rows are marked; each dead letter goes once, in order."""
    ledger, enqueue, clock = InMemoryLedger(), RefusingEnqueue(stuck=set()), Clock()
    rt = runtime(base_settings, ledger, enqueue, clock)
    letters: list[int] = []
    acknowledging = asyncio.Event()

    async def dead_letter(message: Any, error: Any) -> None:
        await acknowledging.wait()  # the dead-letter topic does not acknowledge until set
        letters.append(exactjson.loads(message.value)["n"])

    rt.dead_letter = dead_letter  # type: ignore[method-assign]
    relay = OutboxRelay(rt)
    add_rows(ledger, HEALTHY_A, HEALTHY_A, HEALTHY_C, HEALTHY_A, STUCK)
    for refused in (0, 3, 4):  # rows 1 and 4 of op-0, row 5 of op-1: refused for good
        ledger.outbox[refused].payload["big"] = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await tick(relay) == 1  # within one wait for the round, not one per dead letter, nor for good
    assert loop.time() - started < 2 * ROUND_ACK_WAIT_S
    assert published(ledger) == [3]
    assert letters == []
    deadline = relay.rt.wakeups.outbox.deadline
    assert deadline is not None and deadline - time.monotonic() <= base_settings.relay_interval_s  # a round soon
    acknowledging.set()
    assert await tick(relay) == 4
    assert published(ledger) == [1, 2, 3, 4, 5]
    assert letters == [1, 4, 5]  # each once, in order
