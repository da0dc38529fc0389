"""Which failures of a record make the outbox relay dead-letter its row
(:func:`streams.worker.stages.relay.refused_for_good`):
only Kafka refusing the record itself for good, never an outage or a bug."""

from __future__ import annotations

import aiokafka.errors

from streams.worker.stages.relay import refused_for_good


class ProducerSendError(Exception):
    """Stands for faust's wrapper, which chains aiokafka's error as its cause."""


def wrapped(cause: BaseException) -> BaseException:
    try:
        raise ProducerSendError("Error while sending") from cause
    except ProducerSendError as exc:
        return exc


def test_a_record_too_large_is_refused_for_good_raw_or_wrapped() -> None:
    assert refused_for_good(aiokafka.errors.MessageSizeTooLargeError())
    assert refused_for_good(wrapped(aiokafka.errors.MessageSizeTooLargeError()))


def test_outages_and_bugs_are_not() -> None:
    assert not refused_for_good(aiokafka.errors.KafkaTimeoutError())
    assert not refused_for_good(aiokafka.errors.NotLeaderForPartitionError())  # retriable
    assert not refused_for_good(wrapped(aiokafka.errors.KafkaConnectionError()))
    assert not refused_for_good(TypeError("a bug in the send path"))
    assert not refused_for_good(wrapped(TypeError("a bug")))
