"""Partitions of the product's topics whose writes are blocked: no leader in the worker's producer metadata.

A record for such a partition waits in the producer until a leader is elected or its delivery timeout
(``STREAMS_KAFKA_DELIVERY_TIMEOUT_S``) passes; :class:`BlockedPartitions` names them in a log line when the set
changes and in the gauge ``streams_kafka_partitions_blocked{topic, partition}`` (1 while blocked, 0 once a
leader is back).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from streams.metrics import KAFKA_PARTITIONS_BLOCKED

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
