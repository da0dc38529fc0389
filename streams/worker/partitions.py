"""Partitions of the product's topics whose writes are blocked: no leader in the worker's producer metadata.

A record for such a partition waits in the producer until a leader is elected or its delivery timeout
(``STREAMS_KAFKA_DELIVERY_TIMEOUT_S``) passes; :class:`BlockedPartitions` names them in a log line when the set
changes and in the gauge ``streams_kafka_partitions_blocked{topic, partition}`` (1 while blocked, 0 once a
leader is back).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from streams.metrics import KAFKA_BLOCKED_SKIPS, KAFKA_PARTITIONS_BLOCKED

log = logging.getLogger(__name__)

#: Seconds between two looks at the producer's metadata.
BLOCKED_CHECK_INTERVAL_S = 5.0


def blocked_partitions(cluster: Any, topics: Iterable[str]) -> set[tuple[str, int]]:
    """``(topic, partition)`` of every partition of ``topics`` that ``cluster`` (aiokafka's ``ClusterMetadata``)
    knows without a leader. A topic it does not know yet has none."""
    out: set[tuple[str, int]] = set()
    for topic in topics:
        partitions = cluster.partitions_for_topic(topic) or set()
        available = cluster.available_partitions_for_topic(topic) or set()
        out.update((topic, partition) for partition in partitions - available)
    return out


class BlockedPartitions:
    """The blocked partitions last seen, reported on change (a warning naming those newly blocked, an info line
    for those with a leader again) and in the gauge."""

    def __init__(self) -> None:
        self.blocked: set[tuple[str, int]] = set()

    def update(self, blocked: set[tuple[str, int]]) -> None:
        """Record ``blocked`` (from :func:`blocked_partitions`) as the current set."""
        new, healed = blocked - self.blocked, self.blocked - blocked
        for topic, partition in new:
            KAFKA_PARTITIONS_BLOCKED.labels(topic=topic, partition=str(partition)).set(1)
        for topic, partition in healed:
            KAFKA_PARTITIONS_BLOCKED.labels(topic=topic, partition=str(partition)).set(0)
        if new:
            log.warning(
                "Kafka partitions without a leader, their writes wait (at most STREAMS_KAFKA_DELIVERY_TIMEOUT_S): %s",
                ", ".join(f"{topic}[{partition}]" for topic, partition in sorted(new)),
            )
        if healed:
            log.info(
                "Kafka partitions with a leader again: %s",
                ", ".join(f"{topic}[{partition}]" for topic, partition in sorted(healed)),
            )
        self.blocked = blocked


#: Seconds a partition on which a send failed (an outage: no leader, a timeout) is skipped by the outbox relay and
#: the poll scheduler before their records go to it again (a probe): its records would wait
#: ``STREAMS_KAFKA_DELIVERY_TIMEOUT_S`` in the producer and hold up the round of every other partition.
BLOCKED_SKIP_S = 10.0
#: Most seconds a partition is skipped after failed sends: the skip doubles from :data:`BLOCKED_SKIP_S` with each
#: probe that fails again (each probe waits the delivery timeout), and starts over once a send to it succeeds.
BLOCKED_SKIP_MAX_S = 120.0

#: ``partition_of(topic, key)``: the partition the producer's partitioner picks for ``key`` in ``topic``, None when
#: the producer's metadata does not know the topic yet.
PartitionOf = Callable[[str, bytes], "int | None"]


def producer_partition(producer: Any, topic: str, key: bytes) -> int | None:
    """The partition ``producer`` (aiokafka's ``AIOKafkaProducer``, or None) sends a record keyed ``key`` in
    ``topic`` to, by its own partitioner over its metadata; None before the metadata knows ``topic``."""
    metadata = getattr(producer, "_metadata", None)
    if metadata is None or not metadata.partitions_for_topic(topic):
        return None
    partition: int = producer._partition(topic, None, None, None, key, None)
    return partition


def no_partitions(topic: str, key: bytes) -> int | None:
    """A :data:`PartitionOf` that knows no partition (no producer metadata: nothing is ever skipped)."""
    return None


class PartitionRoutes:
    """Which records go to a partition known blocked, for the senders that must not wait on it (the outbox relay,
    the poll scheduler).

    A partition is skipped while the producer's metadata names it leaderless (:meth:`update`, from the worker's
    metadata watch, itself refreshed by the producer) and for :data:`BLOCKED_SKIP_S` after a send to it failed
    with an outage (:meth:`note_failure`), doubling with each failed probe up to :data:`BLOCKED_SKIP_MAX_S`; then
    one round sends to it again (a probe). One key always maps to one
    partition, so skipping keeps each key's records in order. ``clock`` is ``time.monotonic`` (seconds).
    """

    def __init__(
        self,
        partition_of: PartitionOf = no_partitions,
        skip_s: float = BLOCKED_SKIP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.partition_of = partition_of
        self.skip_s = skip_s
        self.clock = clock
        #: Partitions the producer's metadata names leaderless, from :meth:`update`.
        self.leaderless: set[tuple[str, int]] = set()
        #: Partitions a send failed on, and the monotonic second their skipping ends.
        self.failed_until: dict[tuple[str, int], float] = {}
        #: Failed sends to each partition since its last acknowledged one.
        self.strikes: dict[tuple[str, int], int] = {}

    def update(self, leaderless: set[tuple[str, int]]) -> None:
        """Record the partitions the producer's metadata names leaderless now (:func:`blocked_partitions`)."""
        self.leaderless = set(leaderless)

    def route(self, topic: str, key: bytes) -> tuple[str, int] | None:
        """``(topic, partition)`` of a record keyed ``key``, None when the metadata does not know the topic."""
        partition = self.partition_of(topic, key)
        return None if partition is None else (topic, partition)

    def blocked(self, topic: str, key: bytes) -> tuple[str, int] | None:
        """The partition of a record keyed ``key`` when it is to be skipped now, else None."""
        if not self.leaderless and not self.failed_until:  # none blocked: no partitioner call per record
            return None
        route = self.route(topic, key)
        return route if route is not None and self.skipped(route) else None

    def skipped(self, route: tuple[str, int]) -> bool:
        """True while ``(topic, partition)`` is to be skipped (leaderless, or a send failed under
        :attr:`skip_s` ago)."""
        if route in self.leaderless:
            return True
        until = self.failed_until.get(route)
        if until is None:
            return False
        if self.clock() >= until:  # time for a probe
            del self.failed_until[route]
            return False
        return True

    def next_probe_in_s(self) -> float | None:
        """Seconds until the first partition skipped after a failed send is probed again (0 when one is due); None
        when no partition is skipped for a failed send."""
        if not self.failed_until:
            return None
        return max(0.0, min(self.failed_until.values()) - self.clock())

    def note_failure(self, topic: str, key: bytes, *, others_acked: bool = True) -> tuple[str, int] | None:
        """Skip the partition of a record keyed ``key`` whose send failed with an outage: :attr:`skip_s`, doubled
        for each earlier failure since its last success, at most :data:`BLOCKED_SKIP_MAX_S`; returns that
        partition (None when unknown). ``others_acked`` False (no record of the round was acknowledged: Kafka may
        be down as a whole) skips it :attr:`skip_s` without doubling, so the senders resume soon after Kafka."""
        route = self.route(topic, key)
        if route is not None:
            if not others_acked:
                self.strikes[route] = min(self.strikes.get(route, 0), 1)
            elif route not in self.failed_until:  # one strike per round: a round's failures end together
                self.strikes[route] = self.strikes.get(route, 0) + 1
            strikes = max(self.strikes.get(route, 0), 1)
            skip_s = min(self.skip_s * 2 ** (strikes - 1), max(self.skip_s, BLOCKED_SKIP_MAX_S))
            self.failed_until[route] = self.clock() + skip_s
        return route

    def note_success(self, topic: str, key: bytes) -> None:
        """A record keyed ``key`` was acknowledged: its partition's next failure is skipped :attr:`skip_s` again."""
        if self.strikes:
            route = self.route(topic, key)
            if route is not None:
                self.strikes.pop(route, None)


def report_skipped(
    what: str,
    skipped: dict[tuple[str, int], int],
    *,
    failed: bool = False,
    in_flight: bool = False,
    not_handed_over: bool = False,
) -> None:
    """Name in a log line and count in ``streams_kafka_blocked_skips_total{what, topic, partition}`` the records
    ``what`` (``outbox relay``, ``poll scheduler``) left for a later round: ``skipped`` maps each partition to how
    many; ``failed`` when their send failed (the partition is skipped from now), ``in_flight`` when they were sent
    and are not acknowledged within the round's wait (``STREAMS_KAFKA_ROUND_ACK_WAIT_S``: not sent again while in
    flight, the partition is skipped from now), ``not_handed_over`` when the producer did not take them within
    that wait (behind another partition's full batch: not sent, their own partitions are not skipped), else they
    were not sent."""
    if not skipped:
        return
    for (topic, partition), n in skipped.items():
        KAFKA_BLOCKED_SKIPS.labels(what=what, topic=topic, partition=str(partition)).inc(n)
    if not_handed_over:
        why = "they were not handed to the producer in time (behind a blocked partition's full batch), not sent"
    elif in_flight:
        why = "their acknowledgements are overdue (in flight, not sent again), their partitions are skipped"
    elif failed:
        why = "their send failed, their partitions are skipped"
    else:
        why = "their partitions are blocked"
    log.warning(
        "%s: %d record(s) left for a later round, %s (re-probed after %.0f s, doubling up to %.0f s): %s",
        what,
        sum(skipped.values()),
        why,
        BLOCKED_SKIP_S,
        BLOCKED_SKIP_MAX_S,
        ", ".join(f"{topic}[{partition}] x{n}" for (topic, partition), n in sorted(skipped.items())),
    )
