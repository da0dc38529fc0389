"""The worker's periodic snapshot: what its gauges export and its live view shows, read by one background task
every ``web_snapshot_interval_s`` (never per web request).

A snapshot reads the ledger (:func:`streams.ledger.snapshot.read_figures` for the gauges, the on-call overview
for the live view's page), Kafka (the consumer group's lag per consumed topic and the dead-letter topic's
retained records, through one admin client and one group-less consumer kept open between snapshots) and this
worker's intake (partitions whose commits are blocked, from a callable the worker gives). Each part is bounded by
:data:`PART_TIMEOUT_S`; a part that fails keeps its previous figures, counts in
``streams_snapshot_failures_total{part}`` and is logged, and the next snapshot tries again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import CoordinatorLoadInProgressError, KafkaError

from streams import metrics
from streams.bounded import close_within
from streams.config import Settings
from streams.errors import LedgerUnavailableError, error_summary
from streams.kafka_security import client_kwargs
from streams.ledger.snapshot import LedgerFigures, read_figures
from streams.model.states import OperationState
from streams.oncall import operations as operators

log = logging.getLogger(__name__)

#: Seconds one part of a snapshot (the ledger's, Kafka's) may take before it counts as failed.
PART_TIMEOUT_S = 5.0
#: Throughput window (minutes) and rows per on-call queue of the live view's overview.
WINDOW_MIN = 10
QUEUE_ROWS = 50
#: Roles of the topics whose consumer lag is exported.
CONSUMED_ROLES = ("submissions", "polls")

BlockedFn = Callable[[], Mapping[str, int]]


@dataclass
class Snapshot:
    """The latest figures: each part with the Unix time it was read (0.0: never) and the last failure of its
    reading (None when the last attempt succeeded). ``overview`` is :func:`streams.oncall.operations.overview`'s
    data, ``dead_letter_topic`` :func:`streams.oncall.operations.dead_letter_topic`'s shape, ``consumer_lag``
    {topic: records}, ``blocked`` {agent: partitions}."""

    figures: LedgerFigures | None = None
    overview: dict[str, Any] | None = None
    ledger_at: float = 0.0
    ledger_error: str | None = None
    consumer_lag: dict[str, int] = field(default_factory=dict)
    dead_letter_topic: dict[str, Any] | None = None
    kafka_at: float = 0.0
    kafka_error: str | None = None
    blocked: dict[str, int] = field(default_factory=dict)


class KafkaFigures:
    """Reads the consumer group's lag and the dead-letter topic's retained records over clients kept open
    (created at first use, closed and recreated after a failure)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._admin: AIOKafkaAdminClient | None = None
        self._consumer: AIOKafkaConsumer | None = None

    async def _clients(self) -> tuple[AIOKafkaAdminClient, AIOKafkaConsumer]:
        if self._admin is None or self._consumer is None:
            timeout_ms = int(PART_TIMEOUT_S * 1000)
            admin = AIOKafkaAdminClient(**client_kwargs(self.settings), request_timeout_ms=timeout_ms)
            consumer = AIOKafkaConsumer(
                **client_kwargs(self.settings), enable_auto_commit=False, request_timeout_ms=timeout_ms
            )
            self._admin, self._consumer = admin, consumer
            await admin.start()
            await consumer.start()
        return self._admin, self._consumer

    async def read(self) -> tuple[dict[str, int], dict[str, Any]]:
        """({topic: lag}, the dead-letter topic's ``{topic, retained, by_partition, error}``).

        Raises:
            KafkaError, OSError: Kafka did not answer (the clients are closed; the next call opens new ones).
        """
        try:
            return await self._read()
        except BaseException:
            await self.close()
            raise

    async def _read(self) -> tuple[dict[str, int], dict[str, Any]]:
        admin, consumer = await self._clients()
        existing = set(await admin.list_topics())  # asked first: naming a missing topic may have it created
        wanted = [self.settings.topic(r) for r in (*CONSUMED_ROLES, "dead_letter")]
        described = await admin.describe_topics([t for t in wanted if t in existing])
        tps = {d["topic"]: [TopicPartition(d["topic"], p["partition"]) for p in d["partitions"]] for d in described}
        every = [tp for parts in tps.values() for tp in parts]
        end = await consumer.end_offsets(every) if every else {}
        first = await consumer.beginning_offsets(every) if every else {}
        consumed = [tp for role in CONSUMED_ROLES for tp in tps.get(self.settings.topic(role), [])]
        committed = (
            await admin.list_consumer_group_offsets(self.settings.app_id, partitions=consumed) if consumed else {}
        )
        if any(tp not in committed for tp in consumed):  # named partitions come back (-1: none committed) unless
            # aiokafka dropped a group-level error (the coordinator loading or moved, a refusal): a lag read from it
            # would be the topic's
            raise CoordinatorLoadInProgressError(
                f"no committed offsets of group {self.settings.app_id!r} in the answer (a group-level error)"
            )
        lag: dict[str, int] = {}
        for role in CONSUMED_ROLES:
            topic = self.settings.topic(role)
            total = 0
            for tp in tps.get(topic, []):
                meta = committed.get(tp)
                start = meta.offset if meta is not None and meta.offset >= 0 else first[tp]
                total += max(end[tp] - start, 0)
            lag[topic] = total
        dead = self.settings.topic("dead_letter")
        by_partition = {str(tp.partition): end[tp] - first[tp] for tp in sorted(tps.get(dead, []))}
        dead_letters = {
            "topic": dead,
            "retained": sum(by_partition.values()),
            "by_partition": by_partition,
            "error": None,
        }
        return lag, dead_letters

    async def close(self) -> None:
        """Close the clients (idempotent)."""
        admin, consumer = self._admin, self._consumer
        self._admin = self._consumer = None
        if consumer is not None:
            await close_within(consumer.stop(), PART_TIMEOUT_S, "the live view's Kafka consumer")
        if admin is not None:
            await close_within(admin.close(), PART_TIMEOUT_S, "the live view's Kafka admin client")


class Snapshotter:
    """Takes the worker's snapshots (:meth:`take`) and exports them as the gauges of :mod:`streams.metrics`.

    Args:
        pool: the worker's ledger pool.
        settings: the worker's settings (topics, consumer group, Kafka).
        blocked: {agent: partitions whose commits wait behind an event in flight} of this worker now.
    """

    def __init__(self, pool: asyncpg.Pool, settings: Settings, blocked: BlockedFn) -> None:
        self.pool = pool
        self.settings = settings
        self.blocked = blocked
        self.kafka = KafkaFigures(settings)
        self.latest = Snapshot()

    async def take(self) -> Snapshot:
        """Read every part (each bounded by :data:`PART_TIMEOUT_S`), then replace :attr:`latest` (readers see one
        whole snapshot, never one half taken) and set the gauges. Never raises for a service that does not
        answer."""
        snap = dataclasses.replace(self.latest)
        snap.blocked = dict(self.blocked())
        try:
            async with asyncio.timeout(PART_TIMEOUT_S):
                figures, overview = await self._ledger()
        except (LedgerUnavailableError, TimeoutError) as exc:
            snap.ledger_error = error_summary(exc)
            metrics.SNAPSHOT_FAILURES.labels("ledger").inc()
            log.warning("snapshot: the ledger did not answer; keeping the previous figures: %s", snap.ledger_error)
        else:
            snap.figures, snap.overview, snap.ledger_at, snap.ledger_error = figures, overview, time.time(), None
        try:
            async with asyncio.timeout(PART_TIMEOUT_S):
                lag, dead_letters = await self.kafka.read()
        except (KafkaError, OSError, TimeoutError) as exc:
            snap.kafka_error = error_summary(exc)
            metrics.SNAPSHOT_FAILURES.labels("kafka").inc()
            log.warning("snapshot: Kafka did not answer; keeping the previous figures: %s", snap.kafka_error)
        else:
            snap.consumer_lag, snap.dead_letter_topic, snap.kafka_at, snap.kafka_error = (
                lag,
                dead_letters,
                time.time(),
                None,
            )
        self.latest = snap
        export(snap)
        return snap

    async def _ledger(self) -> tuple[LedgerFigures, dict[str, Any]]:
        figures = await read_figures(self.pool)
        overview = await operators.overview(self.pool, window_min=WINDOW_MIN, queue_limit=QUEUE_ROWS)
        return figures, overview

    async def close(self) -> None:
        """Close the Kafka clients."""
        await self.kafka.close()


def export(snap: Snapshot) -> None:
    """Set the gauges of :mod:`streams.metrics` from ``snap`` (parts never read leave their gauges as they are)."""
    if snap.figures is not None:
        f = snap.figures
        for state in {*f.operations, *(s.value for s in OperationState)}:
            metrics.OPERATIONS.labels(state).set(f.operations.get(state, 0))
        for state in operators.DECISION_STATES:
            metrics.DECISION_WAITING.labels(state).set(f.operations.get(state, 0))
            metrics.DECISION_OLDEST_AGE_SECONDS.labels(state).set(f.oldest_age_s.get(state, 0.0))
        metrics.OUTBOX_UNPUBLISHED.set(f.unpublished)
        metrics.OUTBOX_OLDEST_AGE_SECONDS.set(f.outbox_oldest_age_s or 0.0)
        metrics.SNAPSHOT_TIMESTAMP_SECONDS.set(snap.ledger_at)
    for topic, lag in snap.consumer_lag.items():
        metrics.CONSUMER_LAG.labels(topic).set(lag)
    if snap.dead_letter_topic is not None and snap.dead_letter_topic["retained"] is not None:
        metrics.DEAD_LETTERS_RETAINED.set(snap.dead_letter_topic["retained"])
    for agent, blocked in snap.blocked.items():
        metrics.PARTITIONS_BLOCKED.labels(agent).set(blocked)
