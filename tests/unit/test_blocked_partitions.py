"""A Kafka partition whose sends fail (no leader) holds up only its own records in the outbox relay and the poll
scheduler (:class:`streams.worker.partitions.PartitionRoutes`): the other partitions' records go in the same round,
the blocked one's are skipped, then re-probed and published in order once it has a leader again."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import aiokafka.errors
import httpx
import pytest
from prometheus_client import REGISTRY

from streams.config import Settings
from streams.model.states import OperationState as S
from streams.wire import exactjson
from streams.worker.partitions import BLOCKED_CHECK_INTERVAL_S, BLOCKED_SKIP_S, PartitionRoutes
from streams.worker.runtime import Runtime
from streams.worker.stages.relay import OutboxRelay
from streams.worker.stages.scheduler import PollScheduler
from tests.fakes import InMemoryLedger, Operation, OutboxRow, fake_runtime

PARTITIONS = 3
#: Operation ids by the partition the test's partitioner maps them to (the last character's digit, mod 3).
HEALTHY_A, BLOCKED, HEALTHY_C = "op-0", "op-1", "op-2"


def partition_of(topic: str, key: bytes) -> int:
    return int(key.decode()[-1]) % PARTITIONS


@dataclass
class PartitionedSend:
    """The runtime's ``send`` (a :data:`~streams.worker.runtime.SendFn`) over a 3-partition topic: a record for a
    partition in ``down`` fails as aiokafka's does once its delivery timeout passed; ``attempts`` keeps every
    record tried, ``acked`` those acknowledged, in order."""

    down: set[int] = field(default_factory=set)
    attempts: list[tuple[str, bytes, bytes]] = field(default_factory=list)
    acked: list[tuple[str, bytes, bytes]] = field(default_factory=list)

    async def __call__(self, topic: str, key: bytes, value: bytes) -> None:
        self.attempts.append((topic, key, value))
        if partition_of(topic, key) in self.down:
            raise aiokafka.errors.KafkaTimeoutError()
        self.acked.append((topic, key, value))

    def keys(self, records: list[tuple[str, bytes, bytes]]) -> list[str]:
        return [key.decode() for _, key, _ in records]


@dataclass
class Clock:
    t: float = 1000.0

    def __call__(self) -> float:
        return self.t


def runtime(settings: Settings, ledger: InMemoryLedger, send: PartitionedSend, clock: Clock) -> Runtime:
    rt = fake_runtime(settings, lambda request: httpx.Response(500), ledger)
    rt.send = send
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


def published(ledger: InMemoryLedger) -> list[tuple[str, int]]:
    return [(r.operation_id, r.id) for r in ledger.outbox if r.published]


async def test_relay_marks_the_healthy_partitions_and_publishes_the_blocked_one_in_order_once_it_recovers(
    base_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    ledger, send, clock = InMemoryLedger(), PartitionedSend(down={1}), Clock()
    relay = OutboxRelay(runtime(base_settings, ledger, send, clock))
    topic = base_settings.topic("transitions")
    add_rows(ledger, HEALTHY_A, BLOCKED, HEALTHY_C, BLOCKED, HEALTHY_A, HEALTHY_C)
    before = skips("outbox relay", topic, 1)

    caplog.set_level(logging.WARNING)
    assert await relay.tick() == 4  # the same round: the healthy partitions' rows, marked
    assert published(ledger) == [(HEALTHY_A, 1), (HEALTHY_C, 3), (HEALTHY_A, 5), (HEALTHY_C, 6)]
    assert send.keys(send.attempts).count(BLOCKED) == 2  # tried once, failed: its partition is skipped from now
    assert skips("outbox relay", topic, 1) == before + 2
    assert f"{topic}[1] x2" in caplog.text

    add_rows(ledger, HEALTHY_A, BLOCKED, HEALTHY_C)  # rows 7, 8, 9
    assert await relay.tick() == 2  # still blocked: not even sent, the others flow
    assert published(ledger)[-2:] == [(HEALTHY_A, 7), (HEALTHY_C, 9)]
    assert send.keys(send.attempts).count(BLOCKED) == 2
    assert relay._skip_operation_ids() == [BLOCKED]  # left out of the next selections while blocked

    send.down.clear()  # a leader again; the probe comes once the skip time passed
    assert await relay.tick() == 0
    clock.t += BLOCKED_SKIP_S
    assert await relay.tick() == 3
    assert [r.id for r in ledger.outbox if r.operation_id == BLOCKED and r.published] == [2, 4, 8]
    blocked_acked = [exactjson.loads(v)["n"] for _, k, v in send.acked if k == BLOCKED.encode()]
    assert blocked_acked == [2, 4, 8]  # in id order
    assert all(r.published for r in ledger.outbox)


async def test_relay_never_marks_a_row_after_a_failed_row_of_its_operation(base_settings: Settings) -> None:
    ledger, clock = InMemoryLedger(), Clock()
    failing = {1}  # the outbox row whose record fails once

    @dataclass
    class FailFirst(PartitionedSend):
        async def __call__(self, topic: str, key: bytes, value: bytes) -> None:
            if exactjson.loads(value)["n"] in failing:
                self.attempts.append((topic, key, value))
                raise aiokafka.errors.KafkaTimeoutError()
            await super().__call__(topic, key, value)

    send = FailFirst()
    relay = OutboxRelay(runtime(base_settings, ledger, send, clock))
    add_rows(ledger, HEALTHY_A, HEALTHY_A, HEALTHY_C)
    assert await relay.tick() == 1  # row 2 was acknowledged but row 1 of its operation was not: not marked
    assert published(ledger) == [(HEALTHY_C, 3)]
    failing.clear()
    clock.t += BLOCKED_SKIP_S
    assert await relay.tick() == 2
    assert published(ledger) == [(HEALTHY_A, 1), (HEALTHY_A, 2), (HEALTHY_C, 3)]


def pollable(ledger: InMemoryLedger, operation_id: str) -> None:
    now = ledger.now()
    ledger.operations[operation_id] = Operation(
        operation_id, "{}", 0, None, now, "w", state=S.RUNNING, remote_job_id=f"job-{operation_id}", next_poll_at=now
    )


async def test_scheduler_sends_the_healthy_partitions_polls_and_skips_the_blocked_one(
    base_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    ledger, send, clock = InMemoryLedger(), PartitionedSend(down={1}), Clock()
    scheduler = PollScheduler(runtime(base_settings, ledger, send, clock))
    topic = base_settings.topic("polls")
    for operation_id in (HEALTHY_A, BLOCKED, HEALTHY_C):
        pollable(ledger, operation_id)
    before = skips("poll scheduler", topic, 1)

    assert await scheduler.tick() == 2
    assert sorted(send.keys(send.acked)) == [HEALTHY_A, HEALTHY_C]
    assert skips("poll scheduler", topic, 1) == before + 1  # the failed send skips its partition

    caplog.set_level(logging.WARNING)
    ledger.advance(base_settings.visibility_timeout_s)  # every claim returns
    assert await scheduler.tick() == 2
    assert send.keys(send.attempts).count(BLOCKED) == 1  # skipped: not sent again while blocked
    assert skips("poll scheduler", topic, 1) == before + 2
    assert f"{topic}[1] x1" in caplog.text

    send.down.clear()
    clock.t += BLOCKED_SKIP_S  # re-probed
    ledger.advance(base_settings.visibility_timeout_s)
    assert await scheduler.tick() == 3
    assert send.keys(send.acked).count(BLOCKED) == 1


def test_routes_skip_a_leaderless_partition_while_the_metadata_says_so_and_a_failed_one_for_the_skip_time() -> None:
    clock = Clock()
    routes = PartitionRoutes(partition_of, skip_s=10.0, clock=clock)
    assert routes.blocked("t", b"op-1") is None
    routes.update({("t", 1)})
    assert routes.blocked("t", b"op-1") == ("t", 1) and routes.blocked("t", b"op-4") == ("t", 1)
    assert routes.blocked("t", b"op-2") is None
    clock.t += 3600
    assert routes.blocked("t", b"op-1") == ("t", 1)  # the metadata is re-read by the producer itself
    routes.update(set())
    assert routes.blocked("t", b"op-1") is None
    assert routes.note_failure("t", b"op-2") == ("t", 2)
    clock.t += 9.9
    assert routes.blocked("t", b"op-2") == ("t", 2)
    clock.t += 0.1
    assert routes.blocked("t", b"op-2") is None  # a probe
    assert PartitionRoutes().blocked("t", b"op-1") is None  # no partitioner: never skipped


def test_a_partition_failing_its_probes_is_skipped_twice_as_long_each_time_until_a_send_succeeds() -> None:
    clock = Clock()
    routes = PartitionRoutes(partition_of, skip_s=10.0, clock=clock)
    skips_s = []
    for _ in range(6):
        routes.note_failure("t", b"op-1")
        routes.note_failure("t", b"op-4")  # the same round, the same partition: one strike
        start = clock.t
        while routes.blocked("t", b"op-1") is not None:
            clock.t += 1.0
        skips_s.append(clock.t - start)
    assert skips_s == [10.0, 20.0, 40.0, 80.0, 120.0, 120.0]
    routes.note_success("t", b"op-7")
    routes.note_failure("t", b"op-1")
    assert routes.failed_until[("t", 1)] == clock.t + 10.0


def test_failures_in_a_round_where_nothing_was_acknowledged_skip_without_doubling() -> None:
    clock = Clock()
    routes = PartitionRoutes(partition_of, skip_s=10.0, clock=clock)
    for _ in range(4):  # Kafka down as a whole: every probe fails, none is acknowledged
        routes.note_failure("t", b"op-1", others_acked=False)
        assert routes.failed_until[("t", 1)] == clock.t + 10.0
        clock.t += 10.0
        assert routes.blocked("t", b"op-1") is None


async def test_a_round_leaving_rows_for_a_blocked_partition_wakes_the_relay_again_without_new_work(
    base_settings: Settings,
) -> None:
    ledger, send, clock = InMemoryLedger(), PartitionedSend(down={1}), Clock()
    rt = runtime(base_settings, ledger, send, clock)
    relay = OutboxRelay(rt)
    add_rows(ledger, HEALTHY_A)
    assert await relay.tick() == 1
    assert rt.wakeups.outbox.deadline is None  # nothing left: no wake-up of its own
    add_rows(ledger, BLOCKED)
    started = time.monotonic()
    assert await relay.tick() == 0  # its send failed: skipped BLOCKED_SKIP_S, and left for a later round
    deadline = rt.wakeups.outbox.deadline
    assert deadline is not None  # woken again by itself, not only by work or the listening fallback
    assert deadline - started <= BLOCKED_CHECK_INTERVAL_S + 0.5
    assert rt.routes.next_probe_in_s() == BLOCKED_SKIP_S
