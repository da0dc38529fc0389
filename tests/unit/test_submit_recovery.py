"""The submission producer after a timed-out batch: a new producer sends every unacknowledged submission again, in
publication order, none lost or resent once acknowledged."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, OutOfOrderSequenceNumber, RecordTooLargeError
from prometheus_client import REGISTRY

from streams.clients.submit import RESEND_ATTEMPTS, SubmissionProducer
from streams.config import Settings


class FakeProducer:
    """aiokafka's producer as the recovery sees it: ``send`` returns a future the test resolves."""

    def __init__(self, log: list[tuple[int, bytes]], index: int) -> None:
        self.log, self.index = log, index
        self.sent: list[tuple[bytes, asyncio.Future[Any]]] = []
        self.started = self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def send(self, topic: str, value: bytes, key: bytes) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent.append((key, fut))
        self.log.append((self.index, key))
        return fut


class Factory:
    def __init__(self) -> None:
        self.log: list[tuple[int, bytes]] = []
        self.made: list[FakeProducer] = []

    def __call__(self) -> Any:
        self.made.append(FakeProducer(self.log, len(self.made)))
        return self.made[-1]


def resends(reason: str) -> float:
    return REGISTRY.get_sample_value("streams_submission_resends_total", {"reason": reason}) or 0.0


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.parametrize("error", [KafkaTimeoutError, OutOfOrderSequenceNumber])
async def test_a_failed_batch_resends_the_unacknowledged_in_order_with_a_new_producer(error: type[Exception]) -> None:
    factory = Factory()
    before = resends(error.__name__)
    async with SubmissionProducer(Settings(), producer_factory=factory) as producer:
        futures = [await producer.publish(f"op-{i}", b"{}") for i in range(4)]
        first = factory.made[0]
        first.sent[0][1].set_result("meta-0")  # op-0 acknowledged
        first.sent[1][1].set_exception(error())  # op-1's batch timed out: op-1..op-3 are unacknowledged
        await settle()
        later = await producer.publish("op-4", b"{}")  # published during or after the recovery: after the others
        await settle()
        assert len(factory.made) == 2 and first.stopped and factory.made[1].started
        second = factory.made[1]
        assert [key for key, _ in second.sent] == [b"op-1", b"op-2", b"op-3", b"op-4"]
        for i, (_, fut) in enumerate(second.sent):
            fut.set_result(f"meta-again-{i}")
        await settle()
        assert [f.result() for f in futures] == ["meta-0", "meta-again-0", "meta-again-1", "meta-again-2"]
        assert later.result() == "meta-again-3"
    assert resends(error.__name__) - before == 3  # op-1..op-3 sent again; op-4 once


async def test_a_late_acknowledgement_from_the_replaced_producer_is_not_resent() -> None:
    factory = Factory()
    async with SubmissionProducer(Settings(), producer_factory=factory) as producer:
        futures = [await producer.publish(f"op-{i}", b"{}") for i in range(2)]
        first = factory.made[0]
        first.sent[0][1].set_exception(KafkaTimeoutError())
        first.sent[1][1].set_result("meta-1")  # written after all, before the new producer resends
        await settle()
        assert [key for key, _ in factory.made[1].sent] == [b"op-0"]
        factory.made[1].sent[0][1].set_result("meta-0")
        await settle()
        assert [f.result() for f in futures] == ["meta-0", "meta-1"]


async def test_a_submission_fails_after_its_resends_or_for_a_reason_a_new_producer_cannot_fix() -> None:
    factory = Factory()
    async with SubmissionProducer(Settings(), producer_factory=factory) as producer:
        too_large = await producer.publish("big", b"{}")
        factory.made[0].sent[0][1].set_exception(RecordTooLargeError())
        await settle()
        assert isinstance(too_large.exception(), RecordTooLargeError) and len(factory.made) == 1
        stuck = await producer.publish("stuck", b"{}")
        for _ in range(RESEND_ATTEMPTS + 1):
            factory.made[-1].sent[-1][1].set_exception(KafkaTimeoutError())
            await settle()
        assert isinstance(stuck.exception(), KafkaTimeoutError)
        assert len(factory.made) == 1 + RESEND_ATTEMPTS


class Refusing(Factory):
    """Producers whose ``start`` raises the next of ``failures`` (then starts)."""

    def __init__(self, failures: list[BaseException]) -> None:
        super().__init__()
        self.failures = failures
        self.starts = 0

    def __call__(self) -> Any:
        producer = super().__call__()
        real_start = producer.start

        async def start() -> None:
            self.starts += 1
            if self.starts > 1 and self.failures:  # the first producer (the context's) starts
                raise self.failures.pop(0)
            await real_start()

        producer.start = start
        return producer


def start_retries(reason: str) -> float:
    return REGISTRY.get_sample_value("streams_submission_producer_start_retries_total", {"reason": reason}) or 0.0


async def until(cond: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


async def test_a_replacement_that_finds_no_broker_is_started_again_until_one_answers() -> None:
    factory = Refusing([KafkaConnectionError("Unable to bootstrap"), KafkaConnectionError("Unable to bootstrap")])
    before = start_retries("KafkaConnectionError")
    async with SubmissionProducer(Settings(), producer_factory=factory) as producer:
        future = await producer.publish("op-0", b"{}")
        factory.made[0].sent[0][1].set_exception(KafkaTimeoutError())  # the cluster restarts
        await until(lambda: bool(factory.made[-1].sent) and len(factory.made) == 4)
        assert [p.stopped for p in factory.made[1:3]] == [True, True]  # the two that did not start are closed
        factory.made[-1].sent[0][1].set_result("meta-0")
        assert await future == "meta-0"
    assert start_retries("KafkaConnectionError") - before == 2


async def test_a_replacement_that_cannot_start_fails_what_is_pending_and_the_next_submission_tries_again() -> None:
    settings = Settings(kafka_delivery_timeout_s=0.5, kafka_request_timeout_s=0.2, kafka_round_ack_wait_s=0.1)
    outages = [KafkaConnectionError("Unable to bootstrap") for _ in range(50)]
    factory = Refusing(outages)
    async with SubmissionProducer(settings, producer_factory=factory) as producer:
        lost = await producer.publish("op-0", b"{}")
        factory.made[0].sent[0][1].set_exception(KafkaTimeoutError())
        with pytest.raises(KafkaConnectionError):
            await asyncio.wait_for(lost, 5.0)  # the outage outlasted the delivery timeout: said, not hung
        made = len(factory.made)
        assert 2 < made < 50  # retried, within the delivery timeout
        outages.clear()  # the cluster is back
        later = await producer.publish("op-1", b"{}")
        await until(lambda: len(factory.made) == made + 1 and bool(factory.made[-1].sent))
        assert [key for key, _ in factory.made[-1].sent] == [b"op-1"]
        factory.made[-1].sent[0][1].set_result("meta-1")
        assert await later == "meta-1"

    refused = Refusing([RecordTooLargeError()])  # not an outage: no retry, pending fails at once
    async with SubmissionProducer(Settings(), producer_factory=refused) as producer:
        failed = await producer.publish("op-0", b"{}")
        refused.made[0].sent[0][1].set_exception(KafkaTimeoutError())
        with pytest.raises(RecordTooLargeError):
            await asyncio.wait_for(failed, 5.0)
        assert len(refused.made) == 2


class HangingProducer(FakeProducer):
    """A producer whose start and stop never end (aiokafka's idempotent start waiting for its producer id, its
    stop flushing a batch no broker acknowledges)."""

    async def start(self) -> None:
        await asyncio.Event().wait()

    async def stop(self) -> None:
        self.stopped = True
        await asyncio.Event().wait()


async def test_a_producer_that_never_starts_fails_within_the_delivery_timeout_and_is_left_behind() -> None:
    made: list[HangingProducer] = []

    def factory() -> Any:
        made.append(HangingProducer([], len(made)))
        return made[-1]

    settings = Settings(kafka_delivery_timeout_s=0.5, kafka_round_ack_wait_s=0.1, kafka_request_timeout_s=0.5)
    with pytest.raises(KafkaTimeoutError, match=r"did not start within 0\.5 s"):
        async with asyncio.timeout(10):  # the old start waited for good
            async with SubmissionProducer(settings, producer_factory=factory):
                pass
    assert made[0].stopped  # its stop was tried, and cut off
