"""Accounting in PostgreSQL against the real dispatcher, observer and simulator: one record per remote job and
how it was learned, the provider's charge and refund as observed, refunds recorded idempotently."""

from __future__ import annotations

import time
from decimal import Decimal

import asyncpg
import pytest

from streams.ledger.records import RemoteCall
from streams.model.codes import RemoteCallOutcome
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.dispatcher import Dispatcher
from tests.integration.stuck import operation, poll_now, request_text
from tests.support import SimulatorServer as Simulator
from tests.support import real_ledger, wait_for

pytestmark = pytest.mark.integration


def submission(op: str) -> RawMessage:
    request = request_text(max_tokens=20, prompt_words=1000)
    value = f'{{"operation_id": "{op}", "request": {request}, "submitted_at_ms": {int(time.time() * 1000)}}}'
    return RawMessage("generation.submissions", 0, 1, op.encode(), value.encode())


async def observe_to_end(runtime: Runtime, pool: asyncpg.Pool, op: str) -> str:
    async def terminal() -> bool:
        await poll_now(runtime, pool, op)
        return (await operation(pool, op))["state"] in ("succeeded", "failed")

    await wait_for(terminal, 10, f"{op} to end")
    return str((await operation(pool, op))["state"])


async def account(pool: asyncpg.Pool, op: str) -> asyncpg.Record:
    row = await pool.fetchrow("SELECT * FROM remote_jobs WHERE operation_id = $1", op)
    assert row is not None
    return row


async def test_a_2xx_and_a_502_job_are_accounted_with_how_they_were_learned(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await Dispatcher(runtime).handle(submission("op-2xx"))
    await simulator.configure(fault_502_job_id=1.0)
    await Dispatcher(runtime).handle(submission("op-502"))
    for op, via in (("op-2xx", "post_2xx"), ("op-502", "post_502")):
        row = await account(pool, op)
        job = (await simulator.get(f"/_sim/operations/{op}"))["jobs"][0]
        assert (row["remote_job_id"], row["learned_via"], row["outcome"]) == (job["job_id"], via, None)
    summary = await real_ledger(runtime).accounting_summary()
    assert summary["learned_only_via_502"] == 1
    assert summary["jobs_by_learned_via"] == {"post_2xx": 1, "post_502": 1}
    assert summary["jobs_by_outcome"] == {"not_terminal": 2}


async def test_a_job_learned_by_post_but_never_saved_is_still_accounted(runtime: Runtime, pool: asyncpg.Pool) -> None:
    assert await runtime.ledger.accept("op-lost", request_text(), submitted_at_ms=0)
    created, running = RemoteCallOutcome.CREATED, RemoteCallOutcome.RUNNING
    await runtime.ledger.record_remote_call(RemoteCall("op-lost", "POST", 201, created, "job-lost", 3.0, 1))
    await runtime.ledger.record_remote_call(RemoteCall("op-lost", "POST", 201, created, "job-lost", 3.0, 1))  # a repeat
    await runtime.ledger.record_remote_call(RemoteCall("op-lost", "GET", 200, running, "job-lost", 3.0, 1))
    rows = await pool.fetch("SELECT remote_job_id, learned_via FROM remote_jobs")
    assert [tuple(r) for r in rows] == [("job-lost", "post_2xx")]


async def test_charge_of_a_succeeded_job_is_recorded_as_observed(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await Dispatcher(runtime).handle(submission("op-charge"))
    assert await observe_to_end(runtime, pool, "op-charge") == "succeeded"
    job = (await simulator.get("/_sim/operations/op-charge"))["jobs"][0]
    row = await account(pool, "op-charge")
    assert (row["outcome"], row["last_status"], row["charge_currency"]) == ("succeeded", "succeeded", "USD")
    assert row["charge_amount"] == Decimal(job["charge_amount"]) == Decimal("0.0005") + Decimal("0.00003")
    assert row["charge"]["id"].startswith("ch_")
    assert await pool.fetchval("SELECT count(*) FROM refunds") == 0
    summary = await real_ledger(runtime).accounting_summary()
    [charges] = summary["charges"]
    assert (charges["currency"], Decimal(charges["amount"]), charges["jobs"]) == ("USD", Decimal("0.00053"), 1)
    assert summary["refunds_pending"] == 0


async def test_refund_of_a_failed_job_is_recorded_once(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await simulator.configure(fault_job_failed=1.0)
    await Dispatcher(runtime).handle(submission("op-refund"))
    assert await observe_to_end(runtime, pool, "op-refund") == "failed"
    job = (await simulator.get("/_sim/operations/op-refund"))["jobs"][0]
    refunds = await pool.fetch("SELECT refund_id, remote_job_id, amount, currency FROM refunds")
    assert [tuple(r) for r in refunds] == [(job["refund_id"], job["job_id"], Decimal(job["charge_amount"]), "USD")]
    refund = {"id": job["refund_id"], "amount": job["charge_amount"], "currency": "USD"}
    assert await real_ledger(runtime).record_refund(job["job_id"], refund) is False  # the same refund again
    assert await real_ledger(runtime).record_refund(job["job_id"], dict(refund)) is False
    assert await pool.fetchval("SELECT count(*) FROM refunds") == 1
    second = {"id": "rf_second", "amount": "0.00001", "currency": "USD"}
    assert await real_ledger(runtime).record_refund(job["job_id"], second) is True  # another refund id: a new row
    assert await real_ledger(runtime).record_refund(job["job_id"], second) is False
    assert await real_ledger(runtime).record_refund("job-unknown", second) is False  # no accounting record: nothing
    summary = await real_ledger(runtime).accounting_summary()
    assert summary["jobs_by_outcome"] == {"failed": 1}
    [settled] = summary["refunds_settled"]
    assert (settled["currency"], Decimal(settled["amount"]), settled["refunds"]) == (
        "USD",
        Decimal(job["charge_amount"]) + Decimal("0.00001"),
        2,
    )
    assert summary["refunds_pending"] == 0
    assert summary["gets_per_completed_operation"]["operations"] == 1


async def test_a_failed_job_with_a_charge_and_no_refund_is_pending(runtime: Runtime, pool: asyncpg.Pool) -> None:
    assert await runtime.ledger.accept("op-p", request_text(), submitted_at_ms=0)
    await runtime.ledger.record_remote_call(RemoteCall("op-p", "POST", 201, RemoteCallOutcome.CREATED, "job-p", 3.0, 1))
    await pool.execute(
        "UPDATE remote_jobs SET outcome = 'failed', charge = '{}', charge_amount = 0.5 WHERE remote_job_id = 'job-p'"
    )
    assert (await real_ledger(runtime).accounting_summary())["refunds_pending"] == 1
    assert await real_ledger(runtime).record_refund("job-p", {"id": "rf-p", "amount": "0.5", "currency": "USD"})
    assert (await real_ledger(runtime).accounting_summary())["refunds_pending"] == 0
