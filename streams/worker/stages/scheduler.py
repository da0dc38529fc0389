"""The poll scheduler and the reconciler, run on a timer in every worker.

* Poll scheduling lives in PostgreSQL: due operations (``next_poll_at <= now()``) are claimed with
  ``FOR UPDATE SKIP LOCKED`` (workers never claim the same poll twice), their ``next_poll_at`` moves to
  now + visibility timeout, and one event per claim goes to ``generation.polls`` keyed by operation id.
  A poll lost with a crashed worker comes back when its visibility timeout passes. (A job's first poll with a
  short hint is claimed by the save of its job id instead and taken in that worker:
  :mod:`streams.worker.stages.firstpoll`.)
* Back-pressure: a poll must reach an observer before its visibility timeout passes, or it is claimed again
  and its first event arrives stale (the topic then fills with polls nobody can use, and a burst never ends).
  So the polls claimed and not yet taken by an observer (cluster-wide, read from the ledger in the claiming
  statement, so any number of workers agree) stay at most what the observers of every worker took in the last
  ``PACE_WINDOW_S`` seconds, scaled to half the visibility timeout (``TAKE_WITHIN_FRACTION``): at the
  observers' pace they are all taken within half of it. When the observers took few or none lately (start, a
  burst), the bound is ``observer_concurrency``: one worker's slots, which take them within one lease TTL, at
  most the visibility timeout (a setting check). The bound follows the pace up as the observers keep up (each
  round refills what they took), so throughput is not capped; due polls beyond it wait in PostgreSQL, oldest
  first. Claims of workers' rounds at the same instant may each use the room they read: the bound holds
  within one round's room per worker.
* A blocked Kafka partition (:class:`~streams.worker.partitions.PartitionRoutes`): the claimed polls keyed to it
  are not sent (they return after the visibility timeout, as those whose send fails), so the round does not wait
  on it and the polls of the other partitions go at once. A round waits at most ``kafka_round_ack_wait_s`` for its
  acknowledgements: a poll still in flight then is left to the producer (published when acknowledged, else back
  after the visibility timeout) and its partition is skipped from then on, as after a failed send.
* Redis unreachable: no new claims (a poll without a lease would only be dropped by the observer).
* Rate budget: a round claims no more due polls than the account's ``claims`` budget (the GET rate and burst,
  shared by every worker, stopped by a GET's 429 pause) grants for the next round, and gives back what it did
  not use (:mod:`streams.coordination.ratebudget`). Polls thus slow down before the GET budget runs out: due polls wait
  in
  PostgreSQL, oldest first, rather than at observers.
* Reconciliation: an operation left in ``submitting`` longer than ``submitting_stale_after_s`` becomes
  ``uncertain`` with a reason; it is never resubmitted automatically. ``uncertain`` operations are then looked
  up at the provider by :class:`~streams.worker.stages.reconciler.Reconciler` (its own task, when ``lookup_enabled``) or
  decided by an operator.
* Re-dispatch: an operation left in ``accepted`` longer than ``accepted_stale_after_s`` (nothing was sent
  for it) is dispatched again (:meth:`~streams.worker.stages.dispatcher.Dispatcher.redispatch`), in the
  background, through
  the dispatcher's submit lease and fenced claim. Defence in depth: the submission event of an operation is
  acknowledged only once handled (:mod:`streams.worker.inflight`), so its next reader dispatches it anyway.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from typing import Any

from streams import metrics
from streams.config import Settings
from streams.coordination.ratebudget import BudgetKind
from streams.errors import RecordNotHandedOverError
from streams.ledger.records import ClaimBound, DuePoll, SchedulerDue
from streams.outages import is_outage
from streams.wire import exactjson
from streams.worker.partitions import report_skipped
from streams.worker.runtime import Record, Runtime, delivery_error
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.wakeup import FALLBACK

log = logging.getLogger(__name__)

#: Share of the visibility timeout within which the polls claimed and not yet taken should be taken, at the
#: observers' recent pace; the rest is margin for a pace that drops (a slower provider, a worker lost).
TAKE_WITHIN_FRACTION = 0.5
#: How far back the observers' pace is read (s); a shorter take target is read over itself.
PACE_WINDOW_S = 5.0


class NotRead(enum.Enum):
    """The type of :data:`NOT_READ`."""

    NOT_READ = enum.auto()


#: :attr:`PollScheduler.next_due` when the last round made no claim, so read nothing of the next poll due (None
#: means the claim read that no operation is pollable).
NOT_READ = NotRead.NOT_READ

#: Re-dispatches a worker runs at once. A safety net for rare leftovers, kept small: they run beside the agents'
#: slots, from which the HTTP and Redis pool sizes are derived, so they use the Redis pool's spare connections.
REDISPATCH_AT_ONCE = 2


def work_due(due: SchedulerDue) -> bool:
    """True when a poll is due, or an operation has been left ``submitting`` / ``accepted`` past its stale age."""
    return any(d is not None and d <= 0 for d in (due.poll_due_in_s, due.reconcile_due_in_s))


def claim_bound(settings: Settings) -> ClaimBound:
    """The back-pressure on poll claims for these settings (see the module docstring)."""
    take_target_s = settings.visibility_timeout_s * TAKE_WITHIN_FRACTION
    return ClaimBound(
        least=settings.observer_concurrency,
        pace_window_s=min(PACE_WINDOW_S, take_target_s),
        take_target_s=take_target_s,
    )


class PollScheduler:
    """Claims due polls and publishes them; reconciles stale ``submitting`` operations; re-dispatches operations
    left ``accepted``."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._last_reconcile = 0.0
        self._dispatcher = Dispatcher(runtime)
        #: Re-dispatches running in this worker, by operation id.
        self.redispatching: dict[str, asyncio.Task[bool]] = {}
        #: True when the last round claimed as many polls as it could (more may be due), False when fewer.
        self.claimed_all = False
        #: Rounds run, and fallback wake-ups that found no work due in the ledger and so ran none.
        self.rounds = 0
        self.skipped_rounds = 0
        #: What the last round's claim read of the next poll due (:meth:`Ledger.claim_due_polls_and_next`: seconds,
        #: or None when no operation is pollable), or :data:`NOT_READ` when the round made no claim (then
        #: :meth:`run` reads it).
        self.next_due: float | NotRead | None = NOT_READ

    async def run(self) -> None:
        """Scheduling rounds back to back while they claim full batches; between them, sleep until the next poll is
        due: the ledger's earliest ``next_poll_at`` (every worker's), or sooner when this worker schedules one
        (:attr:`Runtime.wakeups` ``.polls``), at most ``wakeup_fallback_s``. A fallback wake-up runs a round only
        when the ledger has work due (:meth:`Ledger.next_due_in_s`: a poll, or an operation to reconcile or
        re-dispatch), else it only reads when (one round trip, no Redis). Due polls a round and the one right
        after it left unclaimed (held back: rate budget, back-pressure, Redis) are tried again after
        ``poll_scheduler_interval_s``. Runs until cancelled."""
        rt = self.rt
        s = rt.settings
        wakeup = rt.wakeups.polls
        retried = False
        cause: str | None = None
        while True:
            if cause == FALLBACK:
                due = await self._read_due()
                if due is not None and not work_due(due):
                    if due.poll_due_in_s is not None:
                        wakeup.due_in(due.poll_due_in_s)
                    self.skipped_rounds += 1
                    cause = await wakeup.wait(s.wakeup_fallback_s)
                    continue
            try:
                published = await self.tick()
            except Exception:
                log.exception("poll scheduler round failed; retrying")
                published = 0
            self.rounds += 1
            cause = None
            if published and self.claimed_all:
                retried = False
                continue  # the round was full: more may be due
            if self.next_due is not NOT_READ:  # read by the round's claim, in the same statement
                due_in_s = self.next_due
            else:
                due = await self._read_due()
                due_in_s = None if due is None else due.poll_due_in_s
            if due_in_s is not None and due_in_s <= 0:
                if not retried:  # due since the round's claim (or claimed by none yet): one more round at once
                    retried = True
                    continue
                wakeup.due_in(s.poll_scheduler_interval_s)
            elif due_in_s is not None:
                wakeup.due_in(due_in_s)
            retried = False
            cause = await wakeup.wait(s.wakeup_fallback_s)

    async def _read_due(self) -> SchedulerDue | None:
        """When the ledger has work for this scheduler next; None after an outage (reported; the fallback tries
        again)."""
        s = self.rt.settings
        try:
            return await self.rt.ledger.next_due_in_s(s.submitting_stale_after_s, s.accepted_stale_after_s)
        except Exception as exc:
            self.rt.report_failure("poll scheduler", exc)
            return None

    async def tick(self) -> int:
        """One scheduling round; returns the number of polls published. Never raises for outages."""
        rt = self.rt
        self.next_due = NOT_READ
        if not await rt.leases.healthy():
            metrics.COORDINATION_UNAVAILABLE.labels("schedule").inc()
            rt.log_outage("Redis", Exception("PING failed; not claiming polls"))
            return 0
        try:
            await self._maybe_reconcile()
            limit = await self._claim_limit()
            vt_s = rt.settings.visibility_timeout_s
            polls: list[DuePoll] = []
            if limit:
                polls, due_in_s = await rt.ledger.claim_due_polls_and_next(limit, vt_s, claim_bound(rt.settings))
                self.next_due = due_in_s
            self.claimed_all = bool(polls) and len(polls) == limit
            await rt.budget.refund(BudgetKind.CLAIMS, limit - len(polls))  # a no-op when not paced or all used
        except Exception as exc:  # classified by type: an outage waits for the next tick, a bug is logged loudly
            rt.report_failure("poll scheduler", exc)
            return 0
        if not polls:
            return 0
        metrics.POLLS_CLAIMED.inc(len(polls))
        return await self._publish(polls)

    async def _publish(self, polls: list[DuePoll]) -> int:
        """Send one event per claimed poll, but for those whose partition is blocked (they return after the
        visibility timeout, as those whose send fails); returns the number acknowledged."""
        rt = self.rt
        topic = rt.settings.topic("polls")
        skipped: dict[tuple[str, int], int] = {}
        records: list[Record] = []
        for p in polls:
            key = p.operation_id.encode()
            route = rt.routes.blocked(topic, key)
            if route is not None:
                skipped[route] = skipped.get(route, 0) + 1
                continue
            value = {
                "operation_id": p.operation_id,
                "remote_job_id": p.remote_job_id,
                "poll_claim_id": p.poll_claim_id,
                "claimed_at_ms": p.claimed_at_ms,  # the database's clock, not this worker's
            }
            records.append((topic, key, exactjson.dumps(value)))
        report_skipped("poll scheduler", skipped)
        wait_s = rt.settings.kafka_round_ack_wait_s
        deliveries = await rt.send_within(records, wait_s) if records else []
        results = [delivery_error(d) if d.done() else None for d in deliveries]
        not_handed = [r for r in results if isinstance(r, RecordNotHandedOverError)]
        failed = [r for r in results if r is not None and not isinstance(r, RecordNotHandedOverError)]
        for error in {type(r): r for r in failed}.values():  # each kind of failure reported once per tick
            rt.report_failure("poll publish", error)
        failed_on: dict[tuple[str, int], int] = {}
        overdue: dict[tuple[str, int], int] = {}
        acked = any(d.done() and r is None for d, r in zip(deliveries, results, strict=True))
        for (_, key, _), delivery, result in zip(records, deliveries, results, strict=True):
            if not delivery.done():  # in flight past the wait: the producer publishes it or fails it later
                delivery.add_done_callback(functools.partial(self._answered_late, key))
                route = rt.routes.note_failure(topic, key, others_acked=acked)
                if route is not None:
                    overdue[route] = overdue.get(route, 0) + 1
                continue
            if result is None:
                rt.routes.note_success(topic, key)
            outage = result is not None and is_outage(result)
            route = rt.routes.note_failure(topic, key, others_acked=acked) if outage else None
            if route is not None:
                failed_on[route] = failed_on.get(route, 0) + 1
        report_skipped("poll scheduler", failed_on, failed=True)
        report_skipped("poll scheduler", overdue, in_flight=True)
        if not_handed:  # not sent: they return after the visibility timeout; their partitions are not at fault
            log.warning(
                "%d of %d polls not handed to the producer within the round's wait (behind a blocked partition); "
                "they return after the visibility timeout",
                len(not_handed),
                len(polls),
            )
        if failed:
            log.warning(
                "%d of %d polls not published (%s); they return after the visibility timeout",
                len(failed),
                len(polls),
                failed[0],
            )
        return sum(1 for d, r in zip(deliveries, results, strict=True) if d.done() and r is None)

    def _answered_late(self, key: bytes, delivery: asyncio.Future[Any]) -> None:
        """A poll left in flight at its round's wait was answered: acknowledged (published late), or failed (it
        returns after the visibility timeout; reported as a failed send)."""
        rt = self.rt
        topic = rt.settings.topic("polls")
        exc = delivery_error(delivery)
        if exc is None:
            rt.routes.note_success(topic, key)
        elif not isinstance(exc, asyncio.CancelledError):
            rt.report_failure("poll publish", exc)

    async def _claim_limit(self) -> int:
        """How many due polls this round may claim: the batch size, or what the ``claims`` budget grants for the
        next round when the GET rate is set (a round that gets none counts in
        ``streams_rate_budget_waits_total{kind="claims"}``)."""
        s = self.rt.settings
        if not self.rt.budget.paces[BudgetKind.CLAIMS].paced:
            return s.poll_batch_size
        grant = await self.rt.budget.take(BudgetKind.CLAIMS, s.poll_batch_size, s.poll_scheduler_interval_s)
        if grant.granted == 0:
            metrics.BUDGET_WAITS.labels(BudgetKind.CLAIMS.value).inc()
        return grant.granted

    async def _maybe_reconcile(self) -> None:
        now = time.monotonic()
        if now - self._last_reconcile < 1.0:
            return
        self._last_reconcile = now
        s = self.rt.settings
        ids = await self.rt.ledger.reconcile_stale_submitting(s.submitting_stale_after_s, s.poll_batch_size)
        if ids:
            metrics.RECONCILED_UNCERTAIN.inc(len(ids))
            log.warning("reconciliation: %d operation(s) stuck in submitting marked uncertain: %s", len(ids), ids[:10])
        room = REDISPATCH_AT_ONCE - len(self.redispatching)
        if room > 0:
            for operation_id, request_text in await self.rt.ledger.stale_accepted(s.accepted_stale_after_s, room):
                if operation_id not in self.redispatching:
                    self._start_redispatch(operation_id, request_text)

    def _start_redispatch(self, operation_id: str, request_text: str) -> None:
        task = asyncio.create_task(self._dispatcher.redispatch(operation_id, request_text))
        self.redispatching[operation_id] = task

        def done(t: asyncio.Task[bool]) -> None:
            self.redispatching.pop(operation_id, None)
            if not t.cancelled() and t.exception() is not None:
                log.error(
                    "re-dispatch of operation %s failed; retried next round", operation_id, exc_info=t.exception()
                )

        task.add_done_callback(done)
