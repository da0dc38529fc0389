"""The wake-up signal of the poll scheduler and the outbox relay (streams.worker.wakeup): coalescing, earliest
deadline, fallback, and the count of wake-ups by cause."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from streams import metrics
from streams.config import Settings
from streams.errors import LedgerUnavailableError
from streams.ledger.notices import NOTIFIED, TRANSITIONS, OutboxListener, notice_cause
from streams.ledger.records import SchedulerDue
from streams.worker.runtime import Runtime
from streams.worker.stages.scheduler import work_due
from streams.worker.wakeup import DUE, FALLBACK, WRITTEN, Wakeup, Wakeups
from tests.fakes import InMemoryLedger, fake_runtime


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def count(loop: str, cause: str) -> float:
    return float(metrics.WAKEUPS.labels(loop, cause)._value.get())


async def test_notifications_before_a_wait_coalesce_into_one_wakeup() -> None:
    wakeup = Wakeup("test_coalesce")
    for cause in (WRITTEN, "notified", WRITTEN):
        wakeup.notify(cause)
    assert await wakeup.wait(fallback_s=3600.0) == WRITTEN  # the first cause, at once
    assert await wakeup.wait(fallback_s=0.0) == FALLBACK  # nothing left: the three were one wake-up
    assert count("test_coalesce", WRITTEN) == 1
    assert count("test_coalesce", "notified") == 0
    assert count("test_coalesce", FALLBACK) == 1


async def test_a_notification_wakes_a_waiting_loop() -> None:
    wakeup = Wakeup("test_wake_waiter")
    waiter = asyncio.create_task(wakeup.wait(fallback_s=3600.0))
    await asyncio.sleep(0)  # the waiter sleeps now
    assert not waiter.done()
    wakeup.notify("notified")
    assert await asyncio.wait_for(waiter, 10.0) == "notified"


async def test_the_earliest_deadline_wins() -> None:
    clock = FakeClock()
    wakeup = Wakeup("test_earliest", clock=clock)
    wakeup.due_in(5.0)
    wakeup.due_in(1.0)
    wakeup.due_in(3.0)  # later than the one known: changes nothing
    assert wakeup.deadline == 1001.0
    clock.now_s = 1000.5
    assert await wakeup.wait(fallback_s=0.0) == FALLBACK  # not due yet
    clock.now_s = 1001.0
    assert await wakeup.wait(fallback_s=3600.0) == DUE
    assert wakeup.deadline is None  # met, then forgotten
    assert count("test_earliest", DUE) == 1


async def test_a_sooner_deadline_wakes_a_waiting_loop() -> None:
    clock = FakeClock()
    wakeup = Wakeup("test_sooner", clock=clock)
    wakeup.due_in(3000.0)
    waiter = asyncio.create_task(wakeup.wait(fallback_s=3600.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    wakeup.due_in(0.0)  # due now: the sleeper re-reads its deadline
    assert await asyncio.wait_for(waiter, 10.0) == DUE


async def test_a_notification_serves_a_passed_deadline_too() -> None:
    clock = FakeClock()
    wakeup = Wakeup("test_serves", clock=clock)
    wakeup.due_in(1.0)
    clock.now_s += 2.0
    wakeup.notify(WRITTEN)
    assert await wakeup.wait(fallback_s=3600.0) == WRITTEN
    assert wakeup.deadline is None
    assert await wakeup.wait(fallback_s=0.0) == FALLBACK


def test_a_notifications_payload_names_its_cause() -> None:
    assert notice_cause("outputs") == NOTIFIED
    assert notice_cause("transitions") == TRANSITIONS
    assert notice_cause("") == NOTIFIED  # migration 0014's trigger: outputs only
    assert notice_cause("something-newer") == NOTIFIED  # unknown: taken for outputs, never later than before


def test_the_relays_fallback_is_long_only_while_its_listener_listens() -> None:
    rt = Runtime.__new__(Runtime)  # only the settings and the listener: no clients
    rt.settings = Settings(wakeup_fallback_s=1.0, wakeup_listening_fallback_s=30.0)
    rt.outbox_listener = None
    assert rt.outbox_fallback_s() == 1.0  # listening off
    rt.outbox_listener = OutboxListener("postgresql://u@127.0.0.1/db", lambda _cause: None, retry_cap_s=1.0)
    assert rt.outbox_fallback_s() == 1.0  # not connected (yet, or any more)
    rt.outbox_listener.backend_pid = 4242
    assert rt.outbox_fallback_s() == 30.0


async def test_a_transitions_notice_wakes_the_relay_after_the_short_fallback_not_at_once() -> None:
    rt = Runtime.__new__(Runtime)
    rt.settings = Settings(wakeup_fallback_s=1.0, wakeup_listening_fallback_s=30.0)
    clock = FakeClock()
    rt.wakeups = Wakeups()
    rt.wakeups.outbox = Wakeup("test_transitions_notice", clock=clock)
    rt._on_outbox_notice(TRANSITIONS)
    assert rt.wakeups.outbox.deadline == clock.now_s + 1.0
    assert not rt.wakeups.outbox.notified
    clock.now_s += 1.0
    assert await rt.wakeups.outbox.wait(fallback_s=3600.0) == DUE


async def test_a_statement_that_wrote_transitions_wakes_its_own_relay_after_the_short_fallback() -> None:
    """A worker's transitions notify no worker (migration 0019.worker-transitions): the ledger's hook wakes the
    writer's relay ``wakeup_fallback_s`` later, one round for every statement of that span, reported as written."""
    settings = Settings(wakeup_fallback_s=1.0, wakeup_listening_fallback_s=30.0)
    ledger = InMemoryLedger()
    rt = fake_runtime(settings, lambda request: httpx.Response(500), ledger=ledger)
    clock = FakeClock()
    rt.wakeups.outbox = Wakeup("test_transitions_written", clock=clock)
    assert ledger.on_transitions_written == rt.transitions_written  # the runtime hears its ledger
    assert await ledger.accept("op-1", '{"input": {}}', submitted_at_ms=0)
    assert rt.wakeups.outbox.deadline == clock.now_s + 1.0
    clock.now_s += 0.5
    assert await ledger.claim_for_submit("op-1") is not None  # later than the deadline known: changes nothing
    assert await ledger.get_operation("op-1") is not None  # a read: no hook
    assert rt.wakeups.outbox.deadline == 1001.0
    clock.now_s += 0.5
    assert await rt.wakeups.outbox.wait(fallback_s=3600.0) == WRITTEN
    assert await rt.wakeups.outbox.wait(fallback_s=0.0) == FALLBACK
    assert count("test_transitions_written", WRITTEN) == 1


async def test_a_stopping_worker_announces_its_transitions_once() -> None:
    ledger = InMemoryLedger()
    rt = fake_runtime(Settings(), lambda request: httpx.Response(500), ledger=ledger)
    await rt.close()
    assert ledger.announcements == 1


class FailingAnnouncement(InMemoryLedger):
    """A ledger whose announcement raises ``error`` and which records that it was closed."""

    error: BaseException = RuntimeError("a bug in the announcement")
    closed = False

    async def announce_transitions(self) -> None:
        raise self.error

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("error", [LedgerUnavailableError("announce transitions"), RuntimeError("a bug")])
async def test_a_failed_announcement_is_logged_and_the_ledger_closed_all_the_same(
    error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = FailingAnnouncement()
    ledger.error = error
    rt = fake_runtime(Settings(), lambda request: httpx.Response(500), ledger=ledger)
    await rt.close()  # raises nothing
    assert ledger.closed
    assert "could not announce this worker's transitions" in caplog.text


async def test_an_outputs_notice_wakes_the_relay_after_the_peer_delay_once_for_all_of_that_span() -> None:
    """Committed outputs' notifications are a back-up (their writer's relay was woken in-process): the relay looks
    ``wakeup_peer_outputs_delay_s`` later, one round for every notification of that span, reported as notified."""
    rt = Runtime.__new__(Runtime)
    rt.settings = Settings(wakeup_fallback_s=1.0, wakeup_peer_outputs_delay_s=0.2)
    clock = FakeClock()
    rt.wakeups = Wakeups()
    rt.wakeups.outbox = Wakeup("test_outputs_notice", clock=clock)
    rt._on_outbox_notice(NOTIFIED)
    first = rt.wakeups.outbox.deadline
    assert first is not None and 1000.1 <= first <= 1000.2  # jittered, so relays notified together wake apart
    assert not rt.wakeups.outbox.notified  # on the old code: woken at once, one round per notification
    clock.now_s += 0.1
    for _ in range(5):
        rt._on_outbox_notice(NOTIFIED)  # later than the deadline known: changes nothing
    rt._on_outbox_notice(TRANSITIONS)
    assert rt.wakeups.outbox.deadline == first
    clock.now_s += 0.1
    assert await rt.wakeups.outbox.wait(fallback_s=3600.0) == NOTIFIED
    assert await rt.wakeups.outbox.wait(fallback_s=0.0) == FALLBACK  # the six were one wake-up
    assert count("test_outputs_notice", NOTIFIED) == 1


async def test_a_deadline_reports_the_cause_that_set_it() -> None:
    clock = FakeClock()
    wakeup = Wakeup("test_deadline_cause", clock=clock)
    wakeup.due_in(2.0)
    wakeup.due_in(1.0, "notified")  # sooner: its cause is reported
    wakeup.due_in(1.5, "other")  # later: changes nothing
    clock.now_s += 1.0
    assert await wakeup.wait(fallback_s=3600.0) == "notified"
    wakeup.due_in(1.0)
    clock.now_s += 1.0
    assert await wakeup.wait(fallback_s=3600.0) == DUE  # a deadline without a cause is due


def test_a_fallback_runs_a_round_only_for_work_due_in_the_ledger() -> None:
    assert not work_due(SchedulerDue(None, None))  # nothing pollable, nothing left submitting or accepted
    assert not work_due(SchedulerDue(0.5, 59.0))
    assert work_due(SchedulerDue(0.0, None))  # a poll due now
    assert work_due(SchedulerDue(None, -0.1))  # an operation past its stale age: reconcile or re-dispatch


async def test_a_sleeper_cancelled_as_it_is_woken_is_cancelled() -> None:
    """A loop stopped (cancelled) in the same turn as a wake-up ends: with ``asyncio.wait_for`` (CPython 3.11) the
    cancel was swallowed when the event's waiter finished first, the sleeper went on to its next round, and the
    worker's shutdown waited for it for good (streams/bounded.py)."""
    wakeup = Wakeup("test_cancel_race")
    sleeper = asyncio.create_task(wakeup.wait(fallback_s=3600.0))
    await asyncio.sleep(0)  # asleep on the event
    wakeup.notify(WRITTEN)  # the event's waiter finishes in the next turn...
    sleeper.cancel()  # ...and the cancel comes in the same one
    with pytest.raises(asyncio.CancelledError):
        await sleeper
