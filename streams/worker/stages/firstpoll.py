"""First polls taken by the worker that saved the job id, when the first poll is due soon.

A job whose first poll is due within ``first_poll_in_process_max_s`` (the POST answer's hint, or
``poll_backoff_base_s`` without one) has that poll claimed by the save of its job id (``save_submitted`` with a
first poll claim id: the claim ``claim_for_observe`` would take, in the same statement) and observed in this worker
once the hint has passed (:meth:`~streams.worker.stages.observer.Observer.observe_first_poll`: the observe lease,
the rate budget, the GET, the fenced save): no poll scheduler claim and no ``generation.polls`` event for it. Every
later poll goes through the poll scheduler.

* Bounded: at most ``observer_concurrency`` first polls wait or run here at once, and they observe in the polls
  agent's slots (this worker's HTTP and Redis pools are sized for those); beyond that, the first poll goes the
  scheduler's way, due at its hint. So does every first poll while the account's GETs are paced
  (``remote_get_rate_per_s``): the scheduler's claims budget then paces all polls, so that they wait in
  PostgreSQL rather than at observers (:mod:`streams.coordination.ratebudget`); and while completion callbacks are
  on (``callbacks_enabled``): a callback during the hint makes the poll due for the scheduler, whose observer would
  GET first and leave this poll a wasted GET. The saves' claims do not count as polls the observers took
  (``poll_taken_at``), so the scheduler's back-pressure follows the pace of its own polls only. During a 429's
  pause of GETs, first polls already held wait for the GET budget in their slots, as claimed polls do.
* A worker lost holding one loses nothing: in the ledger the poll is due again at its hint plus the visibility
  timeout, then claimed by any worker's scheduler, as a claimed poll lost with a worker.
* A newer claim wins: a poll a cancellation recorded during the hint makes due is claimed by a scheduler; its
  observer's claim raises the fencing value, so this poll's save is refused (its GET, made once the lease is free,
  is the one extra GET such a cancellation may cost, as a callback during any poll may: docs/callbacks.md).
* Stopping (:meth:`FirstPolls.close`): the first polls still waiting for their hint are made due at once
  (``reschedule_poll``), so the next worker takes them without waiting out the visibility timeout; one observing is
  cancelled like the observer's polls (a GET abandoned leaves its lease to expire). A save that ends after that
  starts nothing: its poll is due again after the visibility timeout.
* An error out of an observation is counted (``streams_first_polls_total{outcome="failed"}``) and reported as the
  runtime reports failures (an outage logged as one; anything else logged with its traceback and counted in
  ``streams_unexpected_errors_total{where="first_poll"}``), and the poll is made due at once for the scheduler
  (after the visibility timeout when that fails too).
"""

from __future__ import annotations

import asyncio
import logging
import time

from streams import metrics
from streams.coordination.ratebudget import BudgetKind
from streams.errors import error_summary
from streams.ledger.records import FirstPollClaim
from streams.worker.runtime import Runtime
from streams.worker.stages.observer import Observer

log = logging.getLogger(__name__)

#: How long a stopping worker waits for its cancelled first polls to end, and then tries to make its waiting ones due
#: again (s); past it they come back after the visibility timeout.
GIVE_BACK_TIMEOUT_S = 5.0


class FirstPolls:
    """This worker's first polls claimed by its job-id saves (see module docstring).

    Args:
        rt: the worker's runtime; ``first_poll_in_process_max_s`` and ``observer_concurrency`` from its settings.
        observer: observes each poll.
        slots: the polls agent's handling slots, shared (a semaphore of ``observer_concurrency``).
    """

    def __init__(self, rt: Runtime, observer: Observer, slots: asyncio.Semaphore) -> None:
        self.rt = rt
        self.observer = observer
        self.slots = slots
        self.max_hint_s = rt.settings.first_poll_in_process_max_s
        self.limit = rt.settings.observer_concurrency
        self._held = 0  # reserved or running
        self._waiting: dict[str, int] = {}  # operation id -> poll claim id, not yet observing
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def held(self) -> int:
        """First polls reserved, waiting or being observed here."""
        return self._held

    def reserve(self, hint_s: float) -> bool:
        """Room for a first poll due in ``hint_s`` s: True (then :meth:`start` or :meth:`unreserve` follows) when
        the hint is within ``first_poll_in_process_max_s``, fewer than ``observer_concurrency`` are held, the
        account's GETs are not paced and completion callbacks are off (see module docstring)."""
        if self._closed or hint_s > self.max_hint_s or self.max_hint_s <= 0 or self._held >= self.limit:
            return False
        if self.rt.settings.callbacks_enabled or self.rt.budget.paces[BudgetKind.CLAIMS].paced:
            return False
        self._held += 1
        return True

    def unreserve(self) -> None:
        """Give back a reservation whose save claimed no first poll."""
        self._held -= 1

    def start(self, operation_id: str, first: FirstPollClaim, due_at: float) -> None:
        """Observe ``first`` at ``due_at`` (monotonic s), in a task of its own; takes a reservation's place. Once
        closed, nothing starts (the save ended as the worker stopped): the poll is due after the visibility
        timeout."""
        if self._closed:
            self._held -= 1
            log.info(
                "first poll not taken: the worker is stopping; due again after the visibility timeout (%.0f s)",
                self.rt.settings.visibility_timeout_s,
            )
            return
        self._waiting[operation_id] = first.poll_claim_id
        task = asyncio.create_task(self._run(operation_id, first, due_at))
        self._tasks.add(task)

        def ended(done: asyncio.Task[None]) -> None:  # also for a task cancelled before its first step
            self._tasks.discard(done)
            self._waiting.pop(operation_id, None)
            self._held -= 1

        task.add_done_callback(ended)

    async def _run(self, operation_id: str, first: FirstPollClaim, due_at: float) -> None:
        try:
            wait_s = due_at - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            async with self.slots:
                self._waiting.pop(operation_id, None)
                await self.observer.observe_first_poll(operation_id, first)
            metrics.FIRST_POLLS.labels("taken").inc()
        except Exception as exc:  # its own task: nothing above it would log it
            metrics.FIRST_POLLS.labels("failed").inc()
            self.rt.report_failure("first_poll", exc)
            await self._give_back({operation_id: first.poll_claim_id})

    async def close(self) -> None:
        """Stop: cancel every first poll held (waiting at most :data:`GIVE_BACK_TIMEOUT_S` for them to end); make
        those not yet observing due again at once (at most as long again; past it, or on an error, they come back
        after the visibility timeout)."""
        self._closed = True
        waiting = dict(self._waiting)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:  # a cancelled observation still writes its GET's accounting: bounded, as the give-back is
            await asyncio.wait(tasks, timeout=GIVE_BACK_TIMEOUT_S)
        if waiting:
            await self._give_back(waiting)

    async def _give_back(self, polls: dict[str, int]) -> None:
        """Make ``polls`` (operation id -> poll claim id) due at once for any worker's scheduler, within
        :data:`GIVE_BACK_TIMEOUT_S`; a failure is logged (they come back after the visibility timeout)."""
        ledger = self.rt.ledger
        try:
            async with asyncio.timeout(GIVE_BACK_TIMEOUT_S):
                given = await asyncio.gather(*(ledger.reschedule_poll(op, claim, 0.0) for op, claim in polls.items()))
        except Exception as exc:  # said, and the visibility timeout brings them back
            log.warning(
                "%d first polls not made due again (%s); due after the visibility timeout (%.0f s)",
                len(polls),
                error_summary(exc),
                self.rt.settings.visibility_timeout_s,
            )
            return
        metrics.FIRST_POLLS.labels("given_back").inc(sum(1 for ok in given if ok))
