"""Which failures of a record make the outbox relay dead-letter its row
(:func:`streams.worker.stages.relay.refused_for_good`):
only Kafka refusing the record itself for good, never an outage or a bug; and when a relay that found the relay
lock held looks again (:func:`streams.worker.stages.relay.lock_retry_s`)."""

from __future__ import annotations

import aiokafka.errors
import pytest

from streams.worker.stages.relay import LOCK_RETRY_CAP_S, LOCK_RETRY_S, lock_retry_s, refused_for_good


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


def test_a_relay_that_misses_the_lock_in_a_row_looks_again_later_each_time_jittered_and_capped() -> None:
    """:func:`streams.worker.stages.relay.lock_retry_s`: 50 ms after a first miss, doubling for each miss in a row
    up to 400 ms, each times 0.5-1.5 so that relays woken together do not meet at the lock again."""
    assert [lock_retry_s(n, lambda: 0.5) for n in (1, 2, 3, 4, 5, 50)] == pytest.approx(
        [LOCK_RETRY_S, 0.1, 0.2, LOCK_RETRY_CAP_S, LOCK_RETRY_CAP_S, LOCK_RETRY_CAP_S]
    )
    assert lock_retry_s(1, lambda: 0.0) == pytest.approx(0.5 * LOCK_RETRY_S)
    assert lock_retry_s(1, lambda: 0.999) == pytest.approx(1.499 * LOCK_RETRY_S)
    assert (LOCK_RETRY_S, LOCK_RETRY_CAP_S) == (0.05, 0.4)
