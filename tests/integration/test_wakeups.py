"""Wake-ups of the outbox relay on real PostgreSQL and Kafka: committed outputs wake the relay of a worker that did
not write them (LISTEN/NOTIFY, migration 0014.wakeups), without the fallback timer; with no notification the
fallback timer delivers it all the same; a listener whose connection is terminated reconnects (logged, counted).
Wake-ups are asserted by their counts by cause (streams_wakeups_total), never by timing."""

from __future__ import annotations

import asyncio
import logging
import time
import types
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from streams import metrics
from streams.clients.follow import read_topic_to_end
from streams.config import Settings
from streams.ledger import connect_options, notices
from streams.ledger.records import FirstPollClaim, RemoteCall
from streams.ledger.store import Ledger
from streams.worker.runtime import Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.relay import OutboxRelay
from streams.worker.stages.scheduler import PollScheduler
from streams.worker.wakeup import DUE, FALLBACK, WRITTEN
from tests.integration.test_dispatcher import submission
from tests.integration.test_relay_and_dead_letters import for_op, succeeded_operation
from tests.support import stop_tasks, wait_for

pytestmark = pytest.mark.integration

RELAY = "relay_outbox"
#: Rows one succeeded operation with one output puts in the outbox: four transitions and the output.
ROWS_PER_OPERATION = 5


def wakeups(cause: str) -> float:
    return float(metrics.WAKEUPS.labels(RELAY, cause)._value.get())


def notifications(kind: str) -> float:
    return float(metrics.LEDGER_NOTIFICATIONS.labels(kind)._value.get())


def connects(result: str) -> float:
    return float(metrics.LEDGER_LISTENER_CONNECTS.labels(result)._value.get())


@pytest.fixture
async def relay_worker(
    settings: Settings, kafka_send: Callable[[str, bytes, bytes], Awaitable[Any]]
) -> AsyncIterator[Callable[..., Awaitable[Runtime]]]:
    """Start another worker's relay (its own runtime, so none of the writer's in-process signals reach it), with
    or without its outbox listener; everything started is stopped at the end."""
    started: list[tuple[Runtime, list[asyncio.Task[None]]]] = []

    async def start(*, fallback_s: float, listen: bool, listening_fallback_s: float | None = None) -> Runtime:
        relay_settings = settings.replace(
            wakeup_fallback_s=fallback_s, wakeup_listening_fallback_s=listening_fallback_s or fallback_s
        )
        rt = await Runtime.create(relay_settings, kafka_send, worker="relay-worker")
        tasks = [asyncio.create_task(OutboxRelay(rt).run())]
        if listen:
            tasks.append(asyncio.create_task(rt.listen_outbox()))
        started.append((rt, tasks))
        if listen:
            await wait_for(listening(rt), 30.0, "the outbox listener connected")
        return rt

    yield start
    for rt, tasks in started:
        try:
            await stop_tasks(tasks)
        finally:
            await rt.close()


def listening(rt: Runtime, after: int = 0) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        listener = rt.outbox_listener
        return listener is not None and listener.backend_pid is not None and listener.connections > after

    return check


def published(pool: asyncpg.Pool, op: str, rows: int = ROWS_PER_OPERATION) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        n = await pool.fetchval("SELECT count(*) FROM outbox WHERE operation_id = $1 AND published_at IS NOT NULL", op)
        return bool(n == rows)

    return check


async def test_committed_outputs_wake_another_workers_relay_by_notification(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, relay_worker: Callable[..., Awaitable[Runtime]]
) -> None:
    woken = wakeups("listening")
    await relay_worker(fallback_s=3600.0, listen=True)  # the fallback timer never fires within this test
    await wait_for(lambda: _true(wakeups("listening") > woken), 30.0, "the relay woken once by the connection")
    notified, fallbacks, read = wakeups("notified"), wakeups(FALLBACK), notifications("outputs")
    op = f"op-notify-{uuid.uuid4().hex[:6]}"
    await succeeded_operation(runtime, op, outputs=1)  # written by the test's worker, which runs no relay

    await wait_for(published(pool, op), 30.0, "the other worker's relay published every row")
    assert wakeups("notified") > notified
    assert notifications("outputs") > read  # counted by kind (the benchmark reads it)
    assert wakeups(FALLBACK) == fallbacks
    outputs = for_op(await read_topic_to_end(settings, "outputs_delivered"), op)
    assert [o["event_id"] for o in outputs] == [f"output:{op}:out_0"]


async def test_a_listening_relay_sleeps_its_long_fallback_and_is_woken_for_transitions_when_due(
    pool: asyncpg.Pool, relay_worker: Callable[..., Awaitable[Runtime]]
) -> None:
    woken = wakeups("listening")
    # short fallback (the transitions' delay), but while listening the long one: never reached within this test
    await relay_worker(fallback_s=0.2, listen=True, listening_fallback_s=3600.0)
    await wait_for(lambda: _true(wakeups("listening") > woken), 30.0, "the relay woken once by the connection")
    fallbacks, due, notified = wakeups(FALLBACK), wakeups(DUE), wakeups("notified")
    read, outputs_read = notifications("transitions"), notifications("outputs")
    op = f"op-transition-{uuid.uuid4().hex[:6]}"
    # one transition (accepted) and no output, written on a connection that is not a worker's (as an operator's
    # command writes): the trigger notifies it
    assert await Ledger(pool, "operator").accept(op, '{"input": {"prompt": "p", "max_tokens": 1}}', submitted_at_ms=0)

    await wait_for(published(pool, op, rows=1), 30.0, "the other worker's relay published the transition")
    assert wakeups(DUE) > due  # the notification of transitions, due after the short fallback
    assert wakeups(FALLBACK) == fallbacks  # the 0.2 s fallback no longer runs while listening
    assert wakeups("notified") == notified  # transitions alone do not wake it at once
    assert notifications("transitions") > read
    assert notifications("outputs") == outputs_read


async def test_a_workers_transitions_notify_no_other_worker_its_own_relay_publishes_them_and_its_exit_announces(
    settings: Settings,
    pool: asyncpg.Pool,
    migrated: Settings,
    kafka_send: Callable[[str, bytes, bytes], Awaitable[Any]],
    relay_worker: Callable[..., Awaitable[Runtime]],
) -> None:
    """Migration 0019.worker-transitions: transitions from a worker's connections notify nobody (the notifications
    a listener reads come in commit order, so one sent after them proves none came before); the writer's own relay
    is woken in-process (``written``); a worker that stops announces the transitions it may have left."""
    heard: list[tuple[int, str]] = []
    listener = await asyncpg.connect(migrated.database_url.get_secret_value())
    try:
        await listener.add_listener(notices.OUTBOX_CHANNEL, lambda _c, pid, _ch, payload: heard.append((pid, payload)))
        # the writer listens, so its relay's fallback is the long one: only its own signal wakes it within the test
        writer_settings = settings.replace(wakeup_fallback_s=0.2, wakeup_listening_fallback_s=3600.0)
        writer = await Runtime.create(writer_settings, kafka_send, worker="writer-worker")
        tasks = [asyncio.create_task(OutboxRelay(writer).run()), asyncio.create_task(writer.listen_outbox())]
        try:
            await wait_for(listening(writer), 30.0, "the writer's outbox listener connected")
            written = wakeups(WRITTEN)
            mine = f"op-mine-{uuid.uuid4().hex[:6]}"
            assert await writer.ledger.accept(mine, '{"input": {"prompt": "p", "max_tokens": 1}}', submitted_at_ms=0)
            await wait_for(published(pool, mine, rows=1), 30.0, "the writer's own relay published its transition")
            await wait_for(lambda: _true(wakeups(WRITTEN) > written), 30.0, "the writer's relay woken as written")
            async with pool.acquire() as operator:
                theirs = f"op-theirs-{uuid.uuid4().hex[:6]}"
                request = '{"input": {"prompt": "p", "max_tokens": 1}}'
                assert await Ledger(operator, "operator").accept(theirs, request, submitted_at_ms=0)
                await wait_for(lambda: _true(len(heard) > 0), 30.0, "the operator's transition notified")
                assert heard == [(operator.get_server_pid(), notices.TRANSITIONS_PAYLOAD)]  # none of the worker's
        finally:
            await stop_tasks(tasks)

        # a worker that stops with a transition its relay did not publish: another worker's listening relay, whose
        # listening fallback never comes within this test, publishes it 0.2 s after the stopping worker's announcement
        woken = wakeups("listening")
        await relay_worker(fallback_s=0.2, listen=True, listening_fallback_s=3600.0)
        await wait_for(lambda: _true(wakeups("listening") > woken), 30.0, "the relay's round after it connected")
        heard.clear()
        due = wakeups(DUE)
        left = f"op-left-{uuid.uuid4().hex[:6]}"
        try:
            assert await writer.ledger.accept(left, '{"input": {"prompt": "p", "max_tokens": 1}}', submitted_at_ms=0)
        finally:
            await writer.close()
        await wait_for(published(pool, left, rows=1), 30.0, "the other worker's relay published what the writer left")
        assert [payload for _pid, payload in heard] == [notices.TRANSITIONS_PAYLOAD]  # the announcement alone
        assert wakeups(DUE) > due  # woken by it, when due
    finally:
        await listener.close()


async def test_without_notifications_the_fallback_timer_delivers(
    runtime: Runtime, pool: asyncpg.Pool, relay_worker: Callable[..., Awaitable[Runtime]]
) -> None:
    fallbacks, notified = wakeups(FALLBACK), wakeups("notified")
    await relay_worker(fallback_s=0.2, listen=False)  # every notification lost: nobody listens
    op = f"op-fallback-{uuid.uuid4().hex[:6]}"
    await succeeded_operation(runtime, op, outputs=1)

    await wait_for(published(pool, op), 30.0, "the relay published every row by its fallback timer")
    assert wakeups(FALLBACK) > fallbacks
    assert wakeups("notified") == notified


async def test_a_terminated_listener_reconnects_and_wakes_the_relay_again(
    runtime: Runtime,
    pool: asyncpg.Pool,
    settings: Settings,
    relay_worker: Callable[..., Awaitable[Runtime]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="streams.ledger.notices")
    woken = wakeups("listening")
    relay_rt = await relay_worker(fallback_s=3600.0, listen=True)
    await wait_for(lambda: _true(wakeups("listening") > woken), 30.0, "the relay woken once by the connection")
    listener = relay_rt.outbox_listener
    assert listener is not None and listener.backend_pid is not None
    first_pid = listener.backend_pid
    lost = connects("lost")
    woken = wakeups("listening")
    database = settings.database_url.get_secret_value().rpartition("/")[2]
    # only this test's own listener: its backend on this test database
    assert await pool.fetchval("SELECT datname FROM pg_stat_activity WHERE pid = $1", first_pid) == database
    assert await pool.fetchval("SELECT pg_terminate_backend($1)", first_pid)

    await wait_for(listening(relay_rt, after=1), 30.0, "the listener reconnected")
    assert listener.backend_pid != first_pid
    assert connects("lost") == lost + 1
    assert any("connection to PostgreSQL" in r.getMessage() and "lost" in r.getMessage() for r in caplog.records)
    assert any("reconnected, listening" in r.getMessage() for r in caplog.records)

    await wait_for(lambda: _true(wakeups("listening") > woken), 30.0, "the relay woken by the reconnection")
    notified = wakeups("notified")
    op = f"op-relisten-{uuid.uuid4().hex[:6]}"
    await succeeded_operation(runtime, op, outputs=1)
    await wait_for(published(pool, op), 30.0, "the relay published every row after the reconnection")
    assert wakeups("notified") > notified


async def _true(value: bool) -> bool:
    return value


async def test_the_scheduler_sleeps_until_the_ledgers_next_due_poll(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, kafka_send: Callable[[str, bytes, bytes], Awaitable[Any]]
) -> None:
    op = f"op-due-{uuid.uuid4().hex[:6]}"
    assert await runtime.ledger.accept(op, '{"input": {"prompt": "p", "max_tokens": 1}}', submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit(op)
    assert fencing is not None
    # scheduled by the test's worker: no in-process signal reaches the scheduler's own runtime
    assert await runtime.ledger.save_submitted(op, fencing, f"job-{op}", 0.5, None)
    scheduler_rt = await Runtime.create(
        settings.replace(wakeup_fallback_s=3600.0, wakeup_listening_fallback_s=3600.0), kafka_send, worker="scheduler"
    )
    due, fallbacks = metrics.WAKEUPS.labels("schedule_polls", "due"), metrics.WAKEUPS.labels("schedule_polls", FALLBACK)
    due_before, fallbacks_before = due._value.get(), fallbacks._value.get()
    task = asyncio.create_task(PollScheduler(scheduler_rt).run())
    try:

        async def claimed() -> bool:
            return bool(await pool.fetchval("SELECT poll_claim_id > 0 FROM operations WHERE operation_id = $1", op))

        await wait_for(claimed, 30.0, "the poll claimed when due")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await scheduler_rt.close()
    assert due._value.get() > due_before  # woken by the deadline read from the ledger
    assert fallbacks._value.get() == fallbacks_before


async def test_a_poll_this_worker_saved_is_claimed_by_its_signal_not_the_fallback(
    pool: asyncpg.Pool, settings: Settings, kafka_send: Callable[[str, bytes, bytes], Awaitable[Any]]
) -> None:
    # one worker: its dispatcher saves the job id (first poll due after the simulator's hint) while its scheduler
    # sleeps with nothing pollable; the fallback never fires within the test, so only the signal can claim it
    rt = await Runtime.create(
        settings.replace(wakeup_fallback_s=3600.0, wakeup_listening_fallback_s=3600.0), kafka_send, worker="one-worker"
    )
    due, fallbacks = metrics.WAKEUPS.labels("schedule_polls", "due"), metrics.WAKEUPS.labels("schedule_polls", FALLBACK)
    task = asyncio.create_task(PollScheduler(rt).run())
    op = f"op-signal-{uuid.uuid4().hex[:6]}"
    try:
        await wait_for(lambda: _true(rt.wakeups.polls.deadline is None), 30.0, "the scheduler asleep, nothing due")
        due_before, fallbacks_before = due._value.get(), fallbacks._value.get()
        await Dispatcher(rt).handle(submission(op))

        async def claimed() -> bool:
            return bool(await pool.fetchval("SELECT poll_claim_id > 0 FROM operations WHERE operation_id = $1", op))

        await wait_for(claimed, 30.0, "the first poll claimed when due")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await rt.close()
    assert await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = $1", op) == "submitted"
    assert due._value.get() > due_before  # woken by the deadline the dispatcher gave after its commit
    assert fallbacks._value.get() == fallbacks_before


async def test_a_fallback_wakeup_with_nothing_due_runs_no_round_and_a_due_poll_still_does(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, kafka_send: Callable[[str, bytes, bytes], Awaitable[Any]]
) -> None:
    # a short fallback, nothing pollable or stale in the test database: each fallback only reads the ledger
    scheduler_rt = await Runtime.create(settings.replace(wakeup_fallback_s=0.05), kafka_send, worker="idle-scheduler")
    scheduler = PollScheduler(scheduler_rt)
    fallbacks = metrics.WAKEUPS.labels("schedule_polls", FALLBACK)
    task = asyncio.create_task(scheduler.run())
    op = f"op-idle-{uuid.uuid4().hex[:6]}"
    try:
        await wait_for(lambda: _true(scheduler.skipped_rounds >= 5), 30.0, "five fallback wake-ups found nothing due")
        assert scheduler.rounds == 1  # the first round only: every fallback since ran none
        rounds, fallbacks_before = scheduler.rounds, fallbacks._value.get()
        # a poll scheduled by another worker (no in-process signal here): the next fallback finds it due
        assert await runtime.ledger.accept(op, '{"input": {"prompt": "p", "max_tokens": 1}}', submitted_at_ms=0)
        fencing = await runtime.ledger.claim_for_submit(op)
        assert fencing is not None
        assert await runtime.ledger.save_submitted(op, fencing, f"job-{op}", 0.0, None)

        async def claimed() -> bool:
            return bool(await pool.fetchval("SELECT poll_claim_id > 0 FROM operations WHERE operation_id = $1", op))

        await wait_for(claimed, 30.0, "the other worker's poll claimed by a fallback round")
        # the claim commits inside the round, which is counted once it returns
        await wait_for(lambda: _true(scheduler.rounds > rounds), 30.0, "the fallback round counted")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await scheduler_rt.close()
    assert scheduler.rounds > rounds
    assert fallbacks._value.get() > fallbacks_before


async def test_a_listener_whose_connection_dies_before_listen_reconnects(
    runtime: Runtime,
    pool: asyncpg.Pool,
    settings: Settings,
    relay_worker: Callable[..., Awaitable[Runtime]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The race: the backend ends (pg_terminate_backend, a restart, a failover) after the connection opened and
    # before LISTEN ran. add_listener raised out of OutboxListener.run, which ended for good: no reconnection,
    # every other worker's rows waited for the relay's fallback from then on.
    real_connect = connect_options.connect
    killed: list[int] = []

    async def connect_then_lose_the_first(*args: Any, **kwargs: Any) -> asyncpg.Connection:
        conn = await real_connect(*args, **kwargs)
        if not killed:  # only this test listener's own first backend, on this test database
            killed.append(conn.get_server_pid())
            assert await pool.fetchval("SELECT pg_terminate_backend($1)", killed[0])
            await wait_for(lambda: _true(conn.is_closed()), 30.0, "the client saw its backend end")
        return conn

    # the listener's own connections only (the pool's go through the real module)
    monkeypatch.setattr(notices, "connect_options", types.SimpleNamespace(connect=connect_then_lose_the_first))
    lost = connects("lost")
    relay_rt = await relay_worker(fallback_s=3600.0, listen=True)  # waits until listening
    listener = relay_rt.outbox_listener
    assert listener is not None and killed and listener.backend_pid not in (None, killed[0])
    assert listener.connections == 1  # the lost connection never listened
    assert connects("lost") == lost + 1

    notified = wakeups("notified")
    op = f"op-listen-race-{uuid.uuid4().hex[:6]}"
    await succeeded_operation(runtime, op, outputs=1)
    await wait_for(published(pool, op), 30.0, "the relay published every row by notification")
    assert wakeups("notified") > notified


async def test_the_first_polls_wakeup_is_due_when_the_ledgers_first_poll_is(
    settings: Settings, kafka_send: Callable[[str, bytes, bytes], Awaitable[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the ledger's first poll is due the hint after its save statement started: the dispatcher's wake-up of its
    # scheduler must not come a save's duration later (no scheduler runs: the deadline stays as the dispatcher set it)
    rt = await Runtime.create(settings, kafka_send, worker="one-worker")
    save = rt.ledger.save_submitted
    calls: list[tuple[float, float]] = []

    async def timed_save(
        operation_id: str,
        fencing: int,
        job_id: str,
        delay_s: float,
        reason: str | None,
        call: RemoteCall | None = None,
        *,
        first_poll_claim_id: uuid.UUID | None = None,
    ) -> bool | FirstPollClaim:
        calls.append((time.monotonic(), delay_s))
        return await save(
            operation_id, fencing, job_id, delay_s, reason, call=call, first_poll_claim_id=first_poll_claim_id
        )

    monkeypatch.setattr(rt.ledger, "save_submitted", timed_save)
    try:
        assert rt.wakeups.polls.deadline is None
        await Dispatcher(rt).handle(submission(f"op-first-{uuid.uuid4().hex[:6]}"))
    finally:
        await rt.close()
    ((saving_at, first_poll_s),) = calls
    deadline = rt.wakeups.polls.deadline
    assert deadline is not None and first_poll_s > 0
    assert deadline <= saving_at + first_poll_s
