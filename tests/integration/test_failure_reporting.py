"""Failures reported by type against the real services: a bug is never logged as an outage, an outage never
counted as a lost lease, and a dead letter that Kafka refuses ends in a loud error instead of a silent loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaProducer

from streams import metrics
from streams.config import Settings, lease_key
from streams.coordination.lease import Lease, LeaseManager, make_redis
from streams.errors import DeadLetterError, InvalidEventError
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.observer import Observer
from streams.worker.stages.relay import OutboxRelay
from streams.worker.stages.scheduler import PollScheduler
from tests.integration.test_observer import claim_poll, submitted_operation
from tests.support import SimulatorServer as Simulator

pytestmark = pytest.mark.integration


def outage_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "unavailable, waiting" in r.getMessage()]


def unexpected(where: str) -> float:
    return float(metrics.UNEXPECTED_ERRORS.labels(where)._value.get())


async def test_a_bug_in_the_scheduler_is_logged_with_its_traceback_not_as_an_outage(
    runtime: Runtime, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(batch_size: int, visibility_timeout_s: float, bound: object = None) -> tuple[list[object], None]:
        return [[]][batch_size], None  # an IndexError: a programming error, PostgreSQL is fine

    monkeypatch.setattr(runtime.ledger, "claim_due_polls_and_next", broken)  # the scheduler's claim
    before = unexpected("poll scheduler")
    with caplog.at_level(logging.INFO):
        assert await PollScheduler(runtime).tick() == 0
    assert outage_lines(caplog) == []
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None and errors[0].exc_info[0] is IndexError
    assert "poll scheduler failed unexpectedly" in errors[0].getMessage()
    assert unexpected("poll scheduler") == before + 1


async def test_postgresql_down_in_the_scheduler_is_an_outage(
    settings: Settings, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    async def no_send(topic: str, key: bytes, value: bytes) -> None:
        raise AssertionError("nothing is published without PostgreSQL")

    rt = await Runtime.create(settings, no_send, worker="pg-down")
    try:
        await rt.ledger_pool().close()  # every statement now fails like a broken connection
        before = metrics.OUTAGE_WAITS.labels("PostgreSQL", "poll scheduler")._value.get()
        unexpected_before = unexpected("poll scheduler")
        with caplog.at_level(logging.INFO):
            assert await PollScheduler(rt).tick() == 0
        assert [line.split(":")[0] for line in outage_lines(caplog)] == ["PostgreSQL unavailable, waiting"]
        assert metrics.OUTAGE_WAITS.labels("PostgreSQL", "poll scheduler")._value.get() == before + 1
        assert unexpected("poll scheduler") == unexpected_before
    finally:
        await rt.remote.aclose()
        await rt.leases.client.aclose()


async def test_a_bug_in_the_relay_is_logged_with_its_traceback_not_as_an_outage(
    runtime: Runtime, caplog: pytest.LogCaptureFixture, simulator: Simulator
) -> None:
    await submitted_operation(runtime, "op-relay-bug")  # its transitions put rows in the outbox

    async def broken_send(topic: str, key: bytes, value: bytes) -> None:
        raise TypeError("a bug in the send path")

    runtime.send = broken_send
    before = unexpected("outbox relay")
    with caplog.at_level(logging.INFO):
        assert await OutboxRelay(runtime).tick() == 0
    assert outage_lines(caplog) == []
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None and errors[0].exc_info[0] is TypeError
    assert unexpected("outbox relay") == before + 1


async def test_redis_down_at_renewal_is_counted_as_an_outage_not_a_lost_lease(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await submitted_operation(runtime, "op-renew-down")
    poll = await claim_poll(runtime, "op-renew-down")
    claim_id = orjson.loads(poll.value or b"")["poll_claim_id"]
    claim = await runtime.ledger.claim_for_observe("op-renew-down", claim_id)
    assert claim is not None
    down = make_redis("redis://127.0.0.1:1/0", 0.3)
    lease = Lease(LeaseManager(down, 2000), lease_key(runtime.settings, "observe", "op-renew-down"), "t", 2000)
    lost = metrics.LEASE_LOST.labels("observe")._value.get()
    unavailable = metrics.COORDINATION_UNAVAILABLE.labels("observe")._value.get()
    try:
        await Observer(runtime)._observe("op-renew-down", claim_id, claim, lease)
    finally:
        await down.aclose()
    assert metrics.LEASE_LOST.labels("observe")._value.get() == lost
    assert metrics.COORDINATION_UNAVAILABLE.labels("observe")._value.get() == unavailable + 1
    assert (await simulator.get("/_sim/operations/op-renew-down"))["jobs"][0]["gets"] == 0


@pytest.fixture
async def small_record_producer(settings: Settings) -> AsyncIterator[AIOKafkaProducer]:
    """A real producer that refuses records over 100 kB (as a broker's ``message.max.bytes`` would)."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all", max_request_size=100_000)
    await producer.start()
    yield producer
    await producer.stop()


async def test_a_dead_letter_kafka_refuses_fails_loudly_after_bounded_attempts(
    settings: Settings, pool: asyncpg.Pool, small_record_producer: AIOKafkaProducer
) -> None:
    async def send(topic: str, key: bytes, value: bytes) -> object:
        return await small_record_producer.send_and_wait(topic, value, key=key)

    rt = await Runtime.create(settings, send, worker="dlq-refused")
    try:
        message = RawMessage(settings.topic("submissions"), 0, 7, b"op-huge", b"x" * 200_000)
        before = unexpected("dead letter")
        async with asyncio.timeout(10):  # a retry loop without end would hit this
            with pytest.raises(DeadLetterError, match=r"not published after 3 attempts.*MessageSizeTooLarge"):
                await rt.dead_letter(message, InvalidEventError("oversized", "value of 200000 bytes"))
        assert unexpected("dead letter") == before + 3
    finally:
        await rt.close()
