"""Outbox rows whose ids commit out of order are all published (real PostgreSQL and Kafka).

A transaction takes its outbox id when it writes the row, not when it commits: a lower id can become
visible after a higher one that the relay has already published. The relay must still publish it (it
selects every unpublished row, never "ids above the last one published").
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import asyncpg
import pytest

from streams import metrics
from streams.clients.follow import read_topic_to_end
from streams.config import Settings
from streams.ledger.pool import create_pool
from streams.ledger.store import OUTBOX_RELAY_LOCK_NAME, Ledger
from streams.worker.runtime import Runtime
from streams.worker.stages.relay import LOCK_RETRY_S, OutboxRelay
from streams.worker.wakeup import LOCK_MISSED

pytestmark = pytest.mark.integration

ACCEPT = "INSERT INTO operations (operation_id, request, updated_by) VALUES ($1, '{}'::jsonb, 'writer')"


async def outbox_id(conn: asyncpg.Connection, op: str) -> int:
    """The id of the operation's outbox row, as seen inside the writer's own transaction."""
    value: int = await conn.fetchval("SELECT id FROM outbox WHERE operation_id=$1", op)
    return value


async def published_event_ids(settings: Settings, prefix: str) -> list[str]:
    records = await read_topic_to_end(settings, "transitions")
    return [r.value["event_id"] for r in records if r.value.get("operation_id", "").startswith(prefix)]


async def test_lower_id_committed_after_a_published_higher_id_is_published(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings
) -> None:
    prefix = f"ooo-{uuid.uuid4().hex[:6]}"
    low_op, high_op = f"{prefix}-low", f"{prefix}-high"
    relay = OutboxRelay(runtime)
    assert await relay.tick() == 0
    async with pool.acquire() as low, pool.acquire() as high:
        low_tx, high_tx = low.transaction(), high.transaction()
        await low_tx.start()
        await low.execute(ACCEPT, low_op)
        await high_tx.start()
        await high.execute(ACCEPT, high_op)
        low_id, high_id = await outbox_id(low, low_op), await outbox_id(high, high_op)
        assert low_id < high_id
        await high_tx.commit()
        assert await relay.tick() == 1  # the higher id, alone: the lower one is not visible yet
        assert await pool.fetchval("SELECT published_at IS NOT NULL FROM outbox WHERE id=$1", high_id)
        await low_tx.commit()
    assert await relay.tick() == 1
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    inserted = await pool.fetch("SELECT id, event_id FROM outbox WHERE operation_id = ANY($1)", [low_op, high_op])
    assert sorted(r["id"] for r in inserted) == [low_id, high_id]
    assert sorted(await published_event_ids(settings, prefix)) == sorted(r["event_id"] for r in inserted)


async def test_concurrent_writers_with_random_commit_delays_lose_no_outbox_row(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings
) -> None:
    """8 writers, each committing 25 transactions after a random delay (0-40 ms) while the relay runs in a
    loop: the event ids read back from Kafka are exactly the ones inserted, each once."""
    prefix = f"soak-{uuid.uuid4().hex[:6]}"
    writers, per_writer = 8, 25
    stop = asyncio.Event()
    ids_out_of_commit_order = 0

    async def writer(w: int) -> None:
        nonlocal ids_out_of_commit_order
        rng = random.Random(w)
        async with pool.acquire() as conn:
            for i in range(per_writer):
                async with conn.transaction():
                    await conn.execute(ACCEPT, f"{prefix}-{w}-{i:03d}")
                    row_id = await outbox_id(conn, f"{prefix}-{w}-{i:03d}")
                    await asyncio.sleep(rng.uniform(0.0, 0.04))
                    newer = await conn.fetchval(
                        "SELECT count(*) FROM outbox WHERE id > $1 AND published_at IS NOT NULL", row_id
                    )
                    ids_out_of_commit_order += 1 if newer else 0

    async def relay_loop() -> None:
        relay = OutboxRelay(runtime)
        while not stop.is_set():
            if not await relay.tick():
                await asyncio.sleep(0.005)

    relaying = asyncio.create_task(relay_loop())
    await asyncio.gather(*(writer(w) for w in range(writers)))
    stop.set()
    await relaying
    await OutboxRelay(runtime).tick()  # whatever committed after the loop's last round
    # The scenario happened: rows were committed after a higher id had already been published.
    assert ids_out_of_commit_order > 0
    inserted = [
        r["event_id"] for r in await pool.fetch("SELECT event_id FROM outbox WHERE operation_id LIKE $1", prefix + "-%")
    ]
    assert len(inserted) == writers * per_writer
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    published = await published_event_ids(settings, prefix)
    print(f"{ids_out_of_commit_order} of {len(inserted)} rows committed after a higher id was published")
    assert sorted(published) == sorted(inserted)


#: The relay's advisory lock (ledger.sql lock_unpublished_outbox), taken as another relay's transaction would.
RELAY_LOCK = f"SELECT pg_try_advisory_xact_lock(hashtext('{OUTBOX_RELAY_LOCK_NAME}'))"


async def test_relay_publishes_nothing_and_locks_no_row_while_another_relay_holds_the_lock(
    runtime: Runtime, pool: asyncpg.Pool
) -> None:
    op = f"held-{uuid.uuid4().hex[:6]}"
    relay = OutboxRelay(runtime)
    await relay.tick()
    await pool.execute(ACCEPT, op)
    row_id = await pool.fetchval("SELECT id FROM outbox WHERE operation_id=$1", op)
    published: list[list[int]] = []

    async def publish(rows: list[dict[str, object]]) -> None:
        published.append([int(str(r["id"])) for r in rows])

    async with pool.acquire() as other:
        async with other.transaction():
            assert await other.fetchval(RELAY_LOCK) is True
            assert await runtime.ledger.relay_outbox(100, publish) is None  # the lock missed, not an empty outbox
            assert published == []
            # the refused relay's statement locked no outbox row: a writer can take the row at once
            assert await other.fetchval("SELECT id FROM outbox WHERE id=$1 FOR UPDATE NOWAIT", row_id) == row_id
        assert await runtime.ledger.relay_outbox(100, publish) == 1  # the lock released with its transaction
    assert published == [[row_id]]
    assert await pool.fetchval("SELECT published_at IS NOT NULL FROM outbox WHERE id=$1", row_id)


async def test_a_relay_that_missed_the_lock_looks_again_shortly_and_publishes_its_rows(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings
) -> None:
    """The rows that woke a relay may have committed after the lock holder's selection: a round that finds the lock
    held (counted) makes the relay look again about LOCK_RETRY_S later, not at its long fallback, and that round
    publishes them once the holder's transaction ended."""
    relay = OutboxRelay(runtime)
    await relay.tick()
    op = f"missed-{uuid.uuid4().hex[:6]}"
    await pool.execute(ACCEPT, op)
    missed = metrics.RELAY_LOCK_MISSED._value.get()
    async with pool.acquire() as other:
        async with other.transaction():
            assert await other.fetchval(RELAY_LOCK) is True
            assert runtime.wakeups.outbox.deadline is None
            assert await relay.tick() == 0
            assert metrics.RELAY_LOCK_MISSED._value.get() == missed + 1
            # on the old code: no deadline, the row left for the 30 s fallback or the next notification
            deadline = runtime.wakeups.outbox.deadline
            assert deadline is not None and deadline - time.monotonic() <= 1.5 * LOCK_RETRY_S
        # the other relay's transaction ended, and its lock with it
    assert await runtime.wakeups.outbox.wait(fallback_s=30.0) == LOCK_MISSED
    assert await relay.tick() == 1
    assert await pool.fetchval("SELECT published_at IS NOT NULL FROM outbox WHERE operation_id=$1", op)
    assert await published_event_ids(settings, op) == [f"transition:{op}:1:accepted"]


async def test_a_probing_round_costs_one_statement_when_the_lock_is_held_or_nothing_waits(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings
) -> None:
    """``relay_outbox(probe=True)`` looks in one statement outside a transaction (``probe_outbox``) and opens the
    round's transaction (BEGIN, the select, the mark, COMMIT) only when the lock is free and a row waits; the old
    rounds cost three statements to find nothing or the lock held."""
    await OutboxRelay(runtime).tick()  # the outbox drained of earlier tests' rows
    own = await create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=1)
    statements: list[str] = []
    async with own.acquire() as conn:
        conn.add_query_logger(lambda q: statements.append(q.query))
    ledger = Ledger(own, "probe-test", batching=False)

    async def publish(rows: list[dict[str, object]]) -> None:
        return None  # every row done with

    try:
        op = f"probed-{uuid.uuid4().hex[:6]}"
        await pool.execute(ACCEPT, f"{op}-0")
        assert await ledger.relay_outbox(100, publish) == 1  # statements prepared (asyncpg's type lookups) first
        assert await ledger.relay_outbox(100, publish, probe=True) == 0
        statements.clear()
        assert await ledger.relay_outbox(100, publish, probe=True) == 0  # nothing waits
        assert len(statements) == 1, statements
        async with pool.acquire() as other:
            async with other.transaction():
                assert await other.fetchval(RELAY_LOCK) is True
                await pool.execute(ACCEPT, op)
                statements.clear()
                assert await ledger.relay_outbox(100, publish, probe=True) is None  # the lock held
                assert len(statements) == 1, statements
        statements.clear()
        assert await ledger.relay_outbox(100, publish, probe=True) == 1  # the lock free and a row waits
        probed = len(statements)
        await pool.execute(ACCEPT, f"{op}-2")
        statements.clear()
        assert await ledger.relay_outbox(100, publish) == 1  # no probe: the round's transaction at once
        assert (probed, len(statements)) == (5, 4), statements  # the probe, BEGIN, the select, the mark, COMMIT
        assert (
            await pool.fetchval(
                "SELECT count(*) FROM outbox WHERE operation_id LIKE $1 AND published_at IS NOT NULL", f"{op}%"
            )
            == 3
        )
    finally:
        await own.close()
