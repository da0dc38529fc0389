"""For the operators' tests: a seeded ledger, and the ``streams`` command line run as a person runs it.

The ledger is seeded through the product's own ledger statements. Nothing seeded is due for any worker: no
operation is left ``submitting``, submitted jobs are next polled in an hour, and no submission is on Kafka.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from streams.config import Settings
from streams.ledger.records import RemoteCall
from streams.ledger.store import Ledger
from streams.model.answers import JobSnapshot
from streams.model.codes import ReasonCode
from streams.model.codes import RemoteCallOutcome as Outcome
from streams.model.states import OperationState
from streams_harness.fleet import STREAMS
from tests.fakes import observed_again
from tests.support import ROOT

#: A reason with markup and quotes: pages must show it as text.
HOSTILE_REASON = 'HTTP 503 without error.job_id <script>document.title="owned"</script> & <b>bold</b>'

STALLED_REASON = "unknown status 'paused' 5 times in a row"

REQUEST = '{"input": {"prompt": "hi", "max_tokens": 3}}'
SUBMITTED_AT_MS = 1_700_000_000_000


@dataclass
class Seeded:
    """Operation ids by state, and the job id of each operation that has one."""

    by_state: dict[str, list[str]] = field(default_factory=dict)
    job_ids: dict[str, str] = field(default_factory=dict)

    def add(self, state: OperationState, op: str) -> None:
        self.by_state.setdefault(state.value, []).append(op)


async def _submitting(ledger: Ledger, op: str) -> int:
    assert await ledger.accept(op, REQUEST, submitted_at_ms=SUBMITTED_AT_MS)
    fencing = await ledger.claim_for_submit(op)
    assert fencing is not None
    return fencing


async def _submitted(ledger: Ledger, seeded: Seeded, op: str, *, via_502: bool = False) -> None:
    fencing = await _submitting(ledger, op)
    job_id = f"job-{op}"
    status, outcome = (502, Outcome.CREATED_VIA_502) if via_502 else (201, Outcome.CREATED)
    await ledger.record_remote_call(RemoteCall(op, "POST", status, outcome, job_id, 12.5, fencing))
    reason = "job id from HTTP 502 error.job_id" if via_502 else None
    assert await ledger.save_submitted(op, fencing, job_id, 3600.0, reason)
    seeded.job_ids[op] = job_id


async def _claimed(ledger: Ledger, op: str, outcome: Outcome) -> int:
    """The observer's claim and one GET with ``outcome``; returns the fencing value."""
    claim = await observed_again(ledger, op)  # its poll claimed by the scheduler, then by an observer
    await ledger.record_remote_call(RemoteCall(op, "GET", 200, outcome, claim.remote_job_id, 3.0, claim.fencing_token))
    return claim.fencing_token


async def _observed(ledger: Ledger, op: str, snapshot: JobSnapshot) -> None:
    fencing = await _claimed(ledger, op, Outcome.answered(snapshot.state))
    assert (await ledger.save_observation(op, fencing, snapshot, None)).value == "saved"


async def seed_ledger(ledger: Ledger, prefix: str) -> Seeded:
    """Operations in accepted (1), submitted (2), succeeded (3, two outputs each), failed (1), uncertain (2, one
    with :data:`HOSTILE_REASON`), stalled (1) and rejected (1), ids ``<prefix>-<state>-<n>``: 11 in all.

    Accounting as the pipeline keeps it: 7 remote jobs, the last succeeded one learned through a 502; the first
    succeeded job charged USD 0.25 and refunded, the failed one charged USD 1.50 without refund."""
    seeded = Seeded()
    op = f"{prefix}-accepted-0"
    assert await ledger.accept(op, REQUEST, submitted_at_ms=SUBMITTED_AT_MS)
    seeded.add(OperationState.ACCEPTED, op)
    for n in range(2):
        op = f"{prefix}-submitted-{n}"
        await _submitted(ledger, seeded, op)
        seeded.add(OperationState.SUBMITTED, op)
    for n in range(3):
        op = f"{prefix}-succeeded-{n}"
        await _submitted(ledger, seeded, op, via_502=n == 2)
        outputs = [{"id": f"out-{i}", "text": f"output {i} of {op}"} for i in range(2)]
        snapshot = JobSnapshot(
            seeded.job_ids[op],
            "succeeded",
            OperationState.SUCCEEDED,
            outputs=outputs,
            completed_at_ms=1_700_000_000_000,
            charge={"id": f"ch-{op}", "amount": "0.25", "currency": "USD"} if n == 0 else None,
            refund={"id": f"rf-{op}", "amount": "0.25", "currency": "USD"} if n == 0 else None,
        )
        await _observed(ledger, op, snapshot)
        seeded.add(OperationState.SUCCEEDED, op)
    op = f"{prefix}-failed-0"
    await _submitted(ledger, seeded, op)
    failed = JobSnapshot(
        seeded.job_ids[op],
        "failed",
        OperationState.FAILED,
        error={"code": "boom", "message": "no"},
        charge={"id": f"ch-{op}", "amount": "1.50", "currency": "USD"},
    )
    await _observed(ledger, op, failed)
    seeded.add(OperationState.FAILED, op)
    for n, reason in enumerate([HOSTILE_REASON, "POST timed out after send (ReadTimeout); a job may exist"]):
        op = f"{prefix}-uncertain-{n}"
        fencing = await _submitting(ledger, op)
        await ledger.record_remote_call(RemoteCall(op, "POST", 503, Outcome.UNKNOWN_OUTCOME, None, 20.0, fencing))
        assert await ledger.save_submission_without_job(
            op, fencing, OperationState.UNCERTAIN, reason, ReasonCode.UNKNOWN_OUTCOME
        )
        seeded.add(OperationState.UNCERTAIN, op)
    op = f"{prefix}-stalled-0"
    await _submitted(ledger, seeded, op)
    fencing = await _claimed(ledger, op, Outcome.UNKNOWN_STATUS)
    assert await ledger.save_stalled(op, fencing, STALLED_REASON, {"http_status": 200, "body": '{"status": "paused"}'})
    seeded.add(OperationState.STALLED, op)
    op = f"{prefix}-rejected-0"
    fencing = await _submitting(ledger, op)
    assert await ledger.save_submission_without_job(
        op, fencing, OperationState.REJECTED, "HTTP 422: bad request", ReasonCode.REFUSED
    )
    seeded.add(OperationState.REJECTED, op)
    return seeded


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


async def streams_cli(settings: Settings, *args: str, env: dict[str, str] | None = None) -> Result:
    """Run ``streams ARGS`` with ``settings`` in its environment; wait at most 60 s."""
    full_env = {**os.environ, **settings.to_env(), **(env or {})}
    proc = await asyncio.create_subprocess_exec(
        STREAMS, *args, env=full_env, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


async def backdate(pool: asyncpg.Pool, operation_id: str, interval: str) -> None:
    """Make ``operation_id`` look as if it entered its state (and made its transitions) ``interval`` earlier."""
    await pool.execute(
        "UPDATE transitions SET at = at - $2::text::interval WHERE operation_id = $1", operation_id, interval
    )
    await pool.execute(
        "UPDATE operations SET state_entered_at = state_entered_at - $2::text::interval WHERE operation_id = $1",
        operation_id,
        interval,
    )
