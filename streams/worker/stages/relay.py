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
it again every round, and every row after it would wait behind it for good. The dead letter is waited for at most
``kafka_round_ack_wait_s`` (the round holds the relay lock and its transaction meanwhile): one not acknowledged by
then leaves the row and the later rows of its operation unmarked, for a round ``relay_interval_s`` later (a dead
letter cut off at the wait may still be written: the dead-letter topic may then hold the row twice).

A blocked partition (no leader, or a send to it just failed: :class:`~streams.worker.partitions.PartitionRoutes`)
holds up only its own rows: they are not sent (their operations are left out of the next selections while it stays
blocked, re-probed every ``BLOCKED_SKIP_S``), the rows acknowledged are marked, and an outage or a bug leaves only
the rows it met (and the later rows of their operations) for a later round. One operation's rows all go to one
partition (keyed by operation id) and are marked in id order, never one before an earlier one.

A round waits at most ``kafka_round_ack_wait_s`` for its acknowledgements, not the whole delivery timeout: a row
still unacknowledged then is in flight, neither lost nor sent again while the producer holds it (that would write
it twice); its partition is skipped from then on (as after a failed send), and the round after its acknowledgement
marks it without sending it (the acknowledgement wakes the relay). Failed by the delivery timeout, it is sent again
by a later round, as a failed send.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import aiokafka.errors

from streams import hooks, metrics
from streams.errors import InvalidEventError, RecordNotHandedOverError, error_summary
from streams.outages import FailureKind, classify
from streams.worker.partitions import BLOCKED_CHECK_INTERVAL_S, report_skipped
from streams.worker.runtime import RawMessage, Record, Runtime, delivery_error
from streams.worker.wakeup import ACKED, LOCK_MISSED

log = logging.getLogger(__name__)

#: Most operations the relay leaves out of its selections while their partition is blocked; beyond, their rows
#: are selected (and skipped) again, and may fill a batch.
MAX_SKIPPED_OPERATIONS = 10_000
#: Most rows the relay remembers as sent and not marked (in flight past their round's wait, or acknowledged
#: after it); beyond, the oldest are forgotten, and such a row is sent again when next selected (a copy with
#: its event id, which downstream drops).
MAX_SENT_ROWS = 10_000
#: How long after a round that found the relay lock held the relay looks again (s): about one publishing round of
#: the holder (a select, Kafka's acknowledgements, a mark); each next miss in a row doubles it, up to
#: :data:`LOCK_RETRY_CAP_S`, and each is jittered (x 0.5-1.5) so that relays woken together do not meet again.
LOCK_RETRY_S = 0.05
LOCK_RETRY_CAP_S = 0.4


def lock_retry_s(misses: int, draw: Callable[[], float] = random.random) -> float:
    """How long after its ``misses``-th round in a row that found the relay lock held a relay looks again (s):
    :data:`LOCK_RETRY_S` doubled for each miss before, at most :data:`LOCK_RETRY_CAP_S`, times 0.5-1.5 (``draw``
    in [0, 1))."""
    base_s = min(LOCK_RETRY_S * 2.0 ** min(max(misses - 1, 0), 16), LOCK_RETRY_CAP_S)
    return base_s * (0.5 + draw())


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
        #: Operations whose rows wait for their blocked partition, with it: left out of the next selections
        #: while it stays blocked (at most :data:`MAX_SKIPPED_OPERATIONS`).
        self.waiting: dict[str, tuple[str, int]] = {}
        #: Deliveries of rows sent and not marked, by outbox id: pending while in flight (never sent again then),
        #: acknowledged (marked by the next round that selects them, without sending).
        self.sent: dict[int, asyncio.Future[Any]] = {}
        #: Rounds in a row that found the relay lock held (0 after a round that took it).
        self.lock_misses = 0
        #: True when the last round published or marked rows: the next one opens its transaction at once, where
        #: after a round that found nothing or the lock held it first probes (one round trip, see
        #: ``Ledger.relay_outbox``), since a wake-up then is often one whose rows another relay already took.
        self.found_rows = False

    async def run(self) -> None:
        """Drain the outbox, then sleep until woken (:attr:`Runtime.wakeups` ``.outbox``: this worker wrote
        outputs (at once) or transitions (``wakeup_fallback_s`` later), a PostgreSQL notification of any worker's
        outputs ``wakeup_peer_outputs_delay_s`` after it, or of transitions written on a connection that is not a
        worker's, or announced by a stopping worker, ``wakeup_fallback_s`` after it, the listener reconnected or
        lost its connection, a look again after a round that found the relay lock held) or at most
        :meth:`Runtime.outbox_fallback_s` (long while listening, short otherwise); after a failed round,
        ``relay_interval_s`` before the next. Runs until cancelled.

        Rows are claimed as by every round (:meth:`tick`): a wake-up only says when to look, so a lost one
        delays a row to the fallback, never loses it."""
        s = self.rt.settings
        while True:
            await self.tick()
            if self.failed:
                await asyncio.sleep(s.relay_interval_s)
            else:
                await self.rt.wakeups.outbox.wait(self.rt.outbox_fallback_s())

    def _skip_operation_ids(self) -> list[str]:
        """The operations to leave out of the next selection: those whose partition is still blocked."""
        routes = self.rt.routes
        self.waiting = {op: route for op, route in self.waiting.items() if routes.skipped(route)}
        return list(self.waiting)

    def _look_again_for_waiting(self) -> None:
        """Rows left for blocked partitions: wake the relay when the first of them is probed again (a failed send's
        skip ends) or the producer's metadata has been read again (:data:`BLOCKED_CHECK_INTERVAL_S`), whichever
        comes first. With no more work to wake it, they would otherwise wait the listening fallback."""
        if not self.waiting:
            return
        probe_s = self.rt.routes.next_probe_in_s()
        self.rt.wakeups.outbox.due_in(
            BLOCKED_CHECK_INTERVAL_S if probe_s is None else min(probe_s, BLOCKED_CHECK_INTERVAL_S)
        )

    def _wait_for(self, operation_id: str, route: tuple[str, int]) -> None:
        if operation_id in self.waiting or len(self.waiting) < MAX_SKIPPED_OPERATIONS:
            self.waiting[operation_id] = route

    def _remember(self, row_id: int, delivery: asyncio.Future[Any]) -> None:
        """Keep the delivery of a row sent and not marked (at most :data:`MAX_SENT_ROWS`, the oldest forgotten)."""
        self.sent[row_id] = delivery
        while len(self.sent) > MAX_SENT_ROWS:
            del self.sent[next(iter(self.sent))]

    def _answered_late(self, row_id: int, operation_id: str, record: Record, delivery: asyncio.Future[Any]) -> None:
        """A record left in flight at its round's wait was answered: acknowledged, its operation is selected again
        and the relay woken to mark its row (not sent again); failed, its row is sent again by a later round."""
        exc = delivery_error(delivery)
        if exc is None:
            self.rt.routes.note_success(record[0], record[1])
            self.waiting.pop(operation_id, None)
            self.rt.wakeups.outbox.notify(ACKED)
            return
        if self.sent.get(row_id) is delivery:
            del self.sent[row_id]
        if not isinstance(exc, asyncio.CancelledError):
            self.rt.report_failure("outbox relay", exc)

    async def _publish(self, rows: list[dict[str, Any]]) -> list[int]:
        """Publish ``rows`` (in id order); returns the ids to mark: those acknowledged and those dead-lettered.

        A row whose partition is blocked (:class:`~streams.worker.partitions.PartitionRoutes`) is not sent, a row
        that met an outage is not marked; in both cases the later rows of its operation this round are not marked
        either (sent again after it, with the same event ids), so an operation's rows are marked in order. A row
        not acknowledged within ``kafka_round_ack_wait_s`` is in flight: not marked, its partition skipped, never
        sent again while in flight (:attr:`sent`), marked by the round after its acknowledgement."""
        rt = self.rt
        topic = rt.settings.topic
        held: set[str] = set()  # operations with a row left for a later round
        resent: set[str] = set()  # operations with a row sent or left afresh: their later rows go again after it
        skipped: dict[tuple[str, int], int] = {}
        overdue: dict[tuple[str, int], int] = {}  # rows in flight past a round's wait, by partition
        late: list[dict[str, Any]] = []  # rows acknowledged after their round: marked, not sent again
        sending: list[tuple[dict[str, Any], Record]] = []
        for row in rows:
            operation_id = row["operation_id"]
            record = (topic(row["topic_role"]), operation_id.encode(), row["payload"].encode())
            delivery = self.sent.get(row["id"])
            if delivery is not None and operation_id in resent:  # an earlier row goes again: this one after it
                del self.sent[row["id"]]
                delivery = None
            if operation_id in held:
                continue
            if delivery is not None:
                if not delivery.done():  # still in flight: never sent twice
                    held.add(operation_id)
                    route = rt.routes.route(record[0], record[1])
                    if route is not None:
                        overdue[route] = overdue.get(route, 0) + 1
                        self._wait_for(operation_id, route)
                    continue
                del self.sent[row["id"]]
                if delivery_error(delivery) is None:
                    late.append(row)
                    continue
            resent.add(operation_id)
            route = rt.routes.blocked(record[0], record[1])
            if route is not None:
                skipped[route] = skipped.get(route, 0) + 1
                self._wait_for(operation_id, route)
                held.add(operation_id)
                continue
            sending.append((row, record))
        wait_s = rt.settings.kafka_round_ack_wait_s
        deliveries = await rt.send_within([record for _, record in sending], wait_s) if sending else []
        done: list[dict[str, Any]] = list(late)
        failed: dict[tuple[str, int], int] = {}
        not_handed: dict[tuple[str, int], int] = {}
        acked = any(d.done() and delivery_error(d) is None for d in deliveries)
        retried: dict[type, BaseException] = {}
        dead_letters: list[tuple[dict[str, Any], Record, BaseException]] = []
        for (row, record), delivery in zip(sending, deliveries, strict=True):
            operation_id = row["operation_id"]
            if not delivery.done():  # in flight past the wait: not lost, and sending it again could write it twice
                self._remember(row["id"], delivery)
                delivery.add_done_callback(functools.partial(self._answered_late, row["id"], operation_id, record))
                held.add(operation_id)
                route = rt.routes.note_failure(record[0], record[1], others_acked=acked)
                if route is not None:
                    overdue[route] = overdue.get(route, 0) + 1
                    self._wait_for(operation_id, route)
                continue
            exc = delivery_error(delivery)
            if isinstance(exc, RecordNotHandedOverError):  # not sent: a later round sends it, its partition is fine
                held.add(operation_id)
                route = rt.routes.route(record[0], record[1])
                if route is not None:
                    not_handed[route] = not_handed.get(route, 0) + 1
                continue
            if exc is not None and not refused_for_good(exc):  # an outage, or a bug (reported as one): left for
                held.add(operation_id)  # a later round (its event id is deterministic)
                retried.setdefault(type(exc), exc)
                route = rt.routes.note_failure(record[0], record[1], others_acked=acked)
                if route is not None:
                    failed[route] = failed.get(route, 0) + 1
                    self._wait_for(operation_id, route)
            elif operation_id in held:  # an earlier row of its operation is left: this one is marked after it
                if exc is None:  # (or sent again after it, when that one goes again)
                    self._remember(row["id"], delivery)
                continue
            elif exc is None:
                done.append(row)
                rt.routes.note_success(record[0], record[1])
            else:
                dead_letters.append((row, record, exc))
        for exc in retried.values():  # each kind of failure reported once per round
            rt.report_failure("outbox relay", exc)
        report_skipped("outbox relay", skipped)
        report_skipped("outbox relay", failed, failed=True)
        report_skipped("outbox relay", overdue, in_flight=True)
        report_skipped("outbox relay", not_handed, not_handed_over=True)
        unsent: dict[str, int] = {}  # operation -> the id of its first row whose dead letter failed
        # one deadline for every dead letter of the round: it holds the relay lock and its transaction meanwhile
        dead_letter_deadline = asyncio.get_running_loop().time() + wait_s
        for row, (target, key, value), exc in dead_letters:  # refused for good: to the dead-letter topic, then marked
            if row["operation_id"] in unsent:  # after an earlier row of its operation: in order, a later round
                continue
            log.error(
                "outbox row %s (%s) of operation %s refused by Kafka for %s (%s); sending it to the dead-letter topic",
                row["id"],
                row["event_id"],
                row["operation_id"],
                target,
                error_summary(exc),
            )
            why = (
                f"outbox row {row['id']} ({row['event_id']}) of operation {row['operation_id']} refused by Kafka "
                f"for {target}: {error_summary(exc)}; its bytes are here: raise the topic's and the "
                "producer's record size limits and republish them"
            )
            try:  # dead_letter waits out outages: bounded by the round's deadline
                async with asyncio.timeout_at(dead_letter_deadline):
                    await rt.dead_letter(
                        RawMessage(target, None, None, key, value), InvalidEventError("unpublishable", why)
                    )
            except Exception as dead_letter_exc:  # not marked, nor the later rows of its operation: a later round
                rt.report_failure("outbox relay", dead_letter_exc)
                unsent[row["operation_id"]] = row["id"]
        if unsent:  # marked in id order per operation: nothing after a row left unmarked
            done = [r for r in done if r["id"] < unsent.get(r["operation_id"], r["id"] + 1)]
            dead_letters = [d for d in dead_letters if d[0]["id"] < unsent.get(d[0]["operation_id"], d[0]["id"] + 1)]
            rt.wakeups.outbox.due_in(rt.settings.relay_interval_s)  # their round, as after a failed one
        now_ms = time.time() * 1000
        published: dict[str, int] = {}  # per topic role: one labelled increment per role and batch
        for row in done:
            published[row["topic_role"]] = published.get(row["topic_role"], 0) + 1
            self._check_expiry(row, now_ms)
        for role, n in published.items():
            metrics.OUTBOX_PUBLISHED.labels(role).inc(n)
        marked = done + [row for row, _, _ in dead_letters]
        hooks.reach(hooks.HookPoint.PUBLISHED_BEFORE_MARK, rows=marked)
        return [row["id"] for row in marked]

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
        """Publish until the outbox is drained or a batch fails; returns rows published. Never raises.

        A round that finds the relay lock held by another relay ends the tick and makes the relay look again
        shortly (:func:`lock_retry_s`; a wake-up with cause ``lock_missed``, sooner if work wakes it; each miss
        counted in ``streams_outbox_relay_lock_missed_total``): the rows that woke it may have committed after the
        holder's selection."""
        s = self.rt.settings
        total = 0
        self.failed = False
        while True:
            try:
                n = await self.rt.ledger.relay_outbox(
                    s.relay_batch_size, self._publish, self._skip_operation_ids(), probe=not self.found_rows
                )
            except Exception as exc:  # nothing was marked; the next tick retries (an outage is waited out there)
                self.rt.report_failure("outbox relay", exc)
                self.failed = True
                self.found_rows = False
                return total
            self.found_rows = bool(n)
            if n is None:  # another relay holds the lock
                metrics.RELAY_LOCK_MISSED.inc()
                self.lock_misses += 1
                wait_s = lock_retry_s(self.lock_misses)
                log.debug("outbox relay: lock held by another relay; looking again in %.3f s", wait_s)
                self.rt.wakeups.outbox.due_in(wait_s, LOCK_MISSED)
                return total
            self.lock_misses = 0
            total += n
            if n < s.relay_batch_size:
                self._look_again_for_waiting()
                return total
