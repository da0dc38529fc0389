"""Concurrent and late completion callbacks against PostgreSQL (docs/callbacks.md, ``note_callback``): one delivery
sent many times at once is recorded exactly once and makes the poll due once; a callback before the job id is saved
records nothing; one for an ended or purged operation changes nothing."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from streams.ledger.store import Ledger

pytestmark = pytest.mark.integration


async def submitted(ledger: Ledger, op: str, job_id: str, first_poll_delay_s: float = 3600.0) -> None:
    """``op`` saved as submitted with ``job_id``, its first poll ``first_poll_delay_s`` away."""
    assert await ledger.accept(op, '{"input": {"prompt": "x"}}', submitted_at_ms=0)
    fencing = await ledger.claim_for_submit(op)
    assert fencing is not None
    assert await ledger.save_submitted(op, fencing, job_id, first_poll_delay_s, None)


async def test_concurrent_duplicates_of_one_delivery_are_recorded_once(ledger: Ledger, pool: asyncpg.Pool) -> None:
    await submitted(ledger, "op-race", "job_race")
    notes = await asyncio.gather(*[ledger.note_callback("msg_race", "job_race") for _ in range(12)])
    assert [n.operation_id for n in notes] == ["op-race"] * 12
    assert sum(n.recorded for n in notes) == 1 and sum(n.made_due for n in notes) == 1
    assert await pool.fetchval("SELECT count(*) FROM callback_deliveries WHERE webhook_id = 'msg_race'") == 1
    assert await pool.fetchval("SELECT next_poll_at <= now() FROM operations WHERE operation_id = 'op-race'")
    # another delivery for the same job, the poll already due: recorded, nothing more changed
    other = await ledger.note_callback("msg_race_2", "job_race")
    assert (other.recorded, other.made_due) == (True, False)


async def test_a_callback_before_the_job_id_is_saved_records_nothing_and_a_retry_finds_it(
    ledger: Ledger, pool: asyncpg.Pool
) -> None:
    assert await ledger.accept("op-early", '{"input": {"prompt": "x"}}', submitted_at_ms=0)
    fencing = await ledger.claim_for_submit("op-early")
    assert fencing is not None
    early = await ledger.note_callback("msg_early", "job_early")  # the POST's answer not saved yet
    assert (early.operation_id, early.recorded, early.made_due) == (None, False, False)
    assert await pool.fetchval("SELECT count(*) FROM callback_deliveries WHERE webhook_id = 'msg_early'") == 0
    assert await ledger.save_submitted("op-early", fencing, "job_early", 3600.0, None)
    retried = await ledger.note_callback("msg_early", "job_early")  # the sender's retry, same webhook-id
    assert (retried.operation_id, retried.recorded, retried.made_due) == ("op-early", True, True)


async def test_a_callback_for_an_ended_operation_changes_nothing(ledger: Ledger, pool: asyncpg.Pool) -> None:
    await submitted(ledger, "op-ended", "job_ended")
    await pool.execute("UPDATE operations SET state = 'canceled', next_poll_at = NULL WHERE operation_id = 'op-ended'")
    before = await pool.fetchrow("SELECT * FROM operations WHERE operation_id = 'op-ended'")
    note = await ledger.note_callback("msg_ended", "job_ended")
    assert (note.operation_id, note.recorded, note.made_due) == ("op-ended", True, False)
    assert await pool.fetchrow("SELECT * FROM operations WHERE operation_id = 'op-ended'") == before
