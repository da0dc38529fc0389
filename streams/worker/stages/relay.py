"""The outbox relay: publishes outbox rows to their topics, then marks them published.

Each ``(operation_id, output_id)`` has exactly one outbox row (unique key) and is published once; a crash
between publishing and marking republishes it with the same deterministic ``event_id`` (header and value),
which downstream drops (:mod:`streams.clients.follow`).

Each round selects every unpublished row (``published_at IS NULL``), in id order, never the ids above the
last one published: a transaction takes its outbox id before it commits, so a lower id can become visible
after a higher one was published, and it is published the next round.

A row Kafka refuses for good (:func:`refused_for_good`: an output over the broker's or producer's record size
limit, say) goes to the dead-letter topic with reason ``unpublishable``, its topic and its bytes (cut as every
dead letter's, with their size and SHA-256), and is marked like a published row: otherwise the relay would offer
it again every round, and every row after it would wait behind it for good. An outage (Kafka not answering) or a
bug marks nothing: the whole batch goes again next round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiokafka.errors

from streams import hooks, metrics
from streams.errors import InvalidEventError
from streams.outages import FailureKind, classify
from streams.worker.runtime import RawMessage, Runtime

log = logging.getLogger(__name__)


def refused_for_good(exc: BaseException) -> bool:
    """True when Kafka refused the record itself and sending it again cannot help: a non-retriable aiokafka
    ``KafkaError`` (``MessageSizeTooLargeError``: the record is over the producer's ``max_request_size`` or the
    broker's ``message.max.bytes``; an invalid record), raised as it is or chained as the ``__cause__`` of a wrapper
    (faust's ``ProducerSendError``). An outage (a retriable ``KafkaError``) or any other exception (a bug) is not."""
    if classify(exc).kind is not FailureKind.ERROR:  # an outage (a timeout is not marked retriable by aiokafka)
        return False
    seen: BaseException | None = exc
    for _ in range(3):
        if isinstance(seen, aiokafka.errors.KafkaError):
            return not seen.retriable
        if seen is None:
            return False
        seen = seen.__cause__
    return False


class OutboxRelay:
    """Publishes outbox batches for one worker (only one relay is active at a time, see the ledger)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        #: True when the last :meth:`tick` stopped at a failure (an outage, a bug) before the outbox was drained.
        self.failed = False

    async def run(self) -> None:
        """Drain the outbox, then sleep until woken (:attr:`Runtime.wakeups` ``.outbox``: this worker wrote
        outputs, a PostgreSQL notification of any worker's outputs, the listener reconnected) or at most
        ``wakeup_fallback_s``; after a failed round, ``relay_interval_s`` before the next. Runs until cancelled.

        Rows are claimed as by every round (:meth:`tick`): a wake-up only says when to look, so a lost one
        delays a row to the fallback, never loses it."""
        s = self.rt.settings
        while True:
            await self.tick()
            if self.failed:
                await asyncio.sleep(s.relay_interval_s)
            else:
                await self.rt.wakeups.outbox.wait(s.wakeup_fallback_s)

    async def _publish(self, rows: list[dict[str, Any]]) -> None:
        rt = self.rt
        topic = rt.settings.topic
        records = [(topic(row["topic_role"]), row["operation_id"].encode(), row["payload"].encode()) for row in rows]
        refused = [
            (row, record, exc)
            for row, record, exc in zip(rows, records, await rt.send_all(records), strict=True)
            if exc is not None
        ]
        retried = [exc for _, _, exc in refused if not refused_for_good(exc)]
        if retried:  # an outage, or a bug (reported as one): nothing is marked, the whole batch goes again next
            raise retried[0]  # round (its event ids are deterministic)
        for row, (target, key, value), exc in refused:  # refused for good: to the dead-letter topic, then marked
            log.error(
                "outbox row %s (%s) of operation %s refused by Kafka for %s (%s: %s); sent to the dead-letter topic",
                row["id"],
                row["event_id"],
                row["operation_id"],
                target,
                type(exc).__name__,
                exc,
            )
            why = (
                f"outbox row {row['id']} ({row['event_id']}) of operation {row['operation_id']} refused by Kafka "
                f"for {target}: {type(exc).__name__}: {exc}; its bytes are here: raise the topic's and the "
                "producer's record size limits and republish them"
            )
            await rt.dead_letter(RawMessage(target, None, None, key, value), InvalidEventError("unpublishable", why))
        dead_lettered = {id(row) for row, _, _ in refused}
        now_ms = time.time() * 1000
        for row in rows:
            if id(row) not in dead_lettered:
                metrics.OUTBOX_PUBLISHED.labels(row["topic_role"]).inc()
                self._check_expiry(row, now_ms)
        hooks.reach(hooks.HookPoint.PUBLISHED_BEFORE_MARK, rows=rows)

    def _check_expiry(self, row: dict[str, Any], now_ms: float) -> None:
        """Count (``streams_outputs_near_expiry_total``) and log an output published with less than
        ``output_expiry_margin_s`` left before its ``expires_at_ms`` (or after it): downstream may find it gone."""
        expires_at_ms = row.get("expires_at_ms")
        if expires_at_ms is None:
            return
        left_s = (expires_at_ms - now_ms) / 1000
        margin_s = self.rt.settings.output_expiry_margin_s
        if left_s < margin_s:
            metrics.OUTPUTS_NEAR_EXPIRY.inc()
            log.warning(
                "output %s of operation %s delivered %.0f s before it expires at the provider (margin %.0f s, "
                "STREAMS_OUTPUT_EXPIRY_MARGIN_S): downstream must fetch it now, or it is gone",
                row["event_id"],
                row["operation_id"],
                left_s,
                margin_s,
            )

    async def tick(self) -> int:
        """Publish until the outbox is drained or a batch fails; returns rows published. Never raises."""
        total = 0
        self.failed = False
        while True:
            try:
                n = await self.rt.ledger.relay_outbox(self.rt.settings.relay_batch_size, self._publish)
            except Exception as exc:  # nothing was marked; the next tick retries (an outage is waited out there)
                self.rt.report_failure("outbox relay", exc)
                self.failed = True
                return total
            total += n
            if n < self.rt.settings.relay_batch_size:
                return total
