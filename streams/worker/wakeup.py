"""Wake-ups of a worker's background loops (the poll scheduler, the outbox relay) from work, not from a tick.

A :class:`Wakeup` is a coalescing signal with an earliest deadline, for one loop in one event loop:

* :meth:`Wakeup.notify` wakes the loop now (work is there: this worker committed outputs, a listener
  reconnected); notifications made while the loop runs coalesce into one wake-up after it;
* :meth:`Wakeup.due_in` wakes it when a deadline passes (a poll becomes due, another worker's outputs' back-up
  round, a look after a missed relay lock), the earliest of those given, reported with the cause that set it;
  a later deadline than one already known changes nothing;
* :meth:`Wakeup.wait` sleeps until either, or at most ``fallback_s`` (a notification that never came, a poll
  another worker scheduled, only delays work: the loop then looks for itself). It returns why it woke, counted in
  ``streams_wakeups_total{loop,cause}``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from streams import metrics

#: Why a loop woke: this worker wrote work for it, a deadline it was given passed, or nothing woke it within its
#: fallback.
WRITTEN = "written"
#: A verified completion callback made a poll due (streams.worker.stages.callbacks).
CALLBACK = "callback"
#: A recorded cancellation made its job's poll due, so the provider's cancel route is called now
#: (streams.worker.stages.canceller).
CANCEL = "cancel"
DUE = "due"
#: A Kafka acknowledgement came after its round stopped waiting (the outbox relay marks its row).
ACKED = "acked"
#: The outbox relay found its lock held by another relay and looks again shortly.
LOCK_MISSED = "lock_missed"
FALLBACK = "fallback"


class Wakeup:
    """A coalescing wake-up signal with an earliest deadline (monotonic clock) for the loop ``loop``."""

    def __init__(self, loop: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.loop = loop
        self._clock = clock
        self._event = asyncio.Event()
        self._cause: str | None = None
        self._deadline: float | None = None
        self._deadline_cause = DUE

    @property
    def deadline(self) -> float | None:
        """The earliest deadline known (monotonic s), None when none."""
        return self._deadline

    @property
    def notified(self) -> bool:
        """True while a :meth:`notify` waits to be taken by :meth:`wait`."""
        return self._cause is not None

    def notify(self, cause: str) -> None:
        """Wake the loop now (or right after its current round); ``cause`` names why (a metric label: a fixed
        word, never a payload). The first cause of several before a wake-up is the one reported."""
        if self._cause is None:
            self._cause = cause
        self._event.set()

    def due_in(self, delay_s: float, cause: str = DUE) -> None:
        """Wake the loop ``delay_s`` seconds from now, unless an earlier deadline is already known; the wake-up
        reports ``cause`` (a fixed word: :data:`DUE`, or what set the deadline, e.g. a notification)."""
        deadline = self._clock() + max(0.0, delay_s)
        if self._deadline is None or deadline < self._deadline:
            self._deadline, self._deadline_cause = deadline, cause
            self._event.set()  # the sleeper re-reads its deadline

    async def wait(self, fallback_s: float) -> str:
        """Sleep until notified, until the earliest deadline passes, or ``fallback_s`` seconds; returns the cause
        (a :meth:`notify` cause, the passed deadline's cause (:data:`DUE` unless :meth:`due_in` named another) or
        :data:`FALLBACK`) and forgets it and the deadline it met."""
        limit = self._clock() + fallback_s
        while True:
            cause = self._take()
            if cause is not None:
                metrics.WAKEUPS.labels(self.loop, cause).inc()
                return cause
            now = self._clock()
            if now >= limit:
                metrics.WAKEUPS.labels(self.loop, FALLBACK).inc()
                return FALLBACK
            until = limit if self._deadline is None else min(limit, self._deadline)
            self._event.clear()
            try:
                async with asyncio.timeout(until - now):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._event.wait()
            except TimeoutError:
                pass  # a deadline or the fallback: read above

    def _take(self) -> str | None:
        """The pending cause (a notification first, then a passed deadline), cleared; None when none."""
        if self._cause is not None:
            cause, self._cause = self._cause, None
            if self._deadline is not None and self._deadline <= self._clock():
                self._deadline = None  # this wake-up serves the deadline too
            return cause
        if self._deadline is not None and self._deadline <= self._clock():
            self._deadline = None
            return self._deadline_cause
        return None


class Wakeups:
    """The wake-ups of one worker: ``polls`` (the poll scheduler) and ``outbox`` (the outbox relay)."""

    def __init__(self) -> None:
        self.polls = Wakeup("schedule_polls")
        self.outbox = Wakeup("relay_outbox")
