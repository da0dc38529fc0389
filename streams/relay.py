"""The outbox relay: publishes outbox rows to their topics, then marks them published.

Each ``(operation_id, output_id)`` has exactly one outbox row (unique key) and is published once; a crash
between publishing and marking republishes it with the same deterministic ``event_id`` (header and value),
which downstream drops (:mod:`streams.downstream`).

Each round selects every unpublished row (``published_at IS NULL``), in id order, never the ids above the
last one published: a transaction takes its outbox id before it commits, so a lower id can become visible
after a higher one was published, and it is published the next round.
"""

from __future__ import annotations

import logging
from typing import Any

from streams import hooks, metrics
from streams.runtime import Runtime

log = logging.getLogger(__name__)


class OutboxRelay:
    """Publishes outbox batches for one worker (only one relay is active at a time, see the ledger)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def _publish(self, rows: list[dict[str, Any]]) -> None:
        rt = self.rt
        topic = rt.settings.topic
        records = [(topic(row["topic_role"]), row["operation_id"].encode(), row["payload"].encode()) for row in rows]
        failures = [exc for exc in await rt.send_all(records) if exc is not None]
        if failures:
            raise failures[0]  # nothing is marked: the whole batch goes again (its event ids are deterministic)
        for row in rows:
            metrics.OUTBOX_PUBLISHED.labels(row["topic_role"]).inc()
        hooks.reach(hooks.HookPoint.PUBLISHED_BEFORE_MARK, rows=rows)

    async def tick(self) -> int:
        """Publish until the outbox is drained or a batch fails; returns rows published. Never raises."""
        total = 0
        while True:
            try:
                n = await self.rt.ledger.relay_outbox(self.rt.settings.relay_batch_size, self._publish)
            except Exception as exc:  # nothing was marked; the next tick retries (an outage is waited out there)
                self.rt.report_failure("outbox relay", exc)
                return total
            total += n
            if n < self.rt.settings.relay_batch_size:
                return total
