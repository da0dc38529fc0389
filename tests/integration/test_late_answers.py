"""Decisions that cannot go wrong silently, on the real ledger, Redis and the provider simulator
(docs/decisions.md): a POST answer that arrives after an operator's ``abandon`` is accounted as created after
the decision, reported, and can be adopted (``rejected -> submitted``, that job only); ``adopt`` asks the provider
for the job first and refuses one it does not know or cannot be asked about, unless overridden (recorded)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import asyncpg
import pytest
from prometheus_client import REGISTRY

from streams.config import Settings
from streams.ledger.store import Ledger
from streams.model.codes import ReasonCode
from streams.model.states import OperationState
from streams.remote.client import RemoteClient, SubmitResult
from streams.worker.runtime import Runtime
from streams.worker.stages.dispatcher import Dispatcher
from tests.integration.operators_support import streams_cli
from tests.integration.test_dispatcher import request_text, submission
from tests.support import SimulatorServer as Simulator

pytestmark = pytest.mark.integration

LATE_METRIC = "streams_jobs_created_after_decision_total"


def late_count(state: str) -> float:
    return REGISTRY.get_sample_value(LATE_METRIC, {"state": state}) or 0.0


async def operation(pool: asyncpg.Pool, op: str) -> dict[str, Any]:
    row = await pool.fetchrow(
        "SELECT state::text AS state, remote_job_id, reason, reason_code, fencing_token FROM operations "
        "WHERE operation_id = $1",
        op,
    )
    assert row is not None
    return dict(row)


async def accounting_rows(pool: asyncpg.Pool, op: str) -> list[tuple[str, str]]:
    rows = await pool.fetch(
        "SELECT remote_job_id, learned_via FROM remote_jobs WHERE operation_id = $1 ORDER BY remote_job_id", op
    )
    return [(r["remote_job_id"], r["learned_via"]) for r in rows]


async def gets(simulator: Simulator) -> int:
    summary = await simulator.get("/_sim/summary")
    count: int = summary["gets"]
    return count


async def abandoned_with_a_late_answer(runtime: Runtime, pool: asyncpg.Pool, op: str) -> str:
    """The race, for real: the dispatcher POSTs and the simulator creates the job and answers 201; the answer is
    held on its way back while the reconciler turns the stale ``submitting`` into ``uncertain`` and an operator
    abandons it; then the dispatcher gets its answer and tries to save it. Returns the job id."""
    answered, release = asyncio.Event(), asyncio.Event()
    real_submit = runtime.remote.submit

    async def late_submit(operation_id: str, request_text: str) -> SubmitResult:
        result = await real_submit(operation_id, request_text)
        answered.set()
        await release.wait()
        return result

    runtime.remote.submit = late_submit  # type: ignore[method-assign]
    handler = asyncio.create_task(Dispatcher(runtime).handle(submission(op)))
    await asyncio.wait_for(answered.wait(), 30)
    assert (await operation(pool, op))["state"] == "submitting"
    assert await runtime.ledger.reconcile_stale_submitting(0.0, 100) == [op]
    move = await Ledger(pool, "alice").abandon(op, "no job in the provider's console", "alice")
    assert move.to_state is OperationState.REJECTED
    release.set()
    await asyncio.wait_for(handler, 30)
    job = await pool.fetchval(
        "SELECT remote_job_id FROM remote_calls WHERE operation_id = $1 AND method = 'POST' AND outcome = 'created'",
        op,
    )
    assert isinstance(job, str)
    return job


async def test_a_late_answer_after_abandon_is_accounted_reported_and_adoptable(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, settings: Settings
) -> None:
    op = "op-late-1"
    before = late_count("rejected")
    job = await abandoned_with_a_late_answer(runtime, pool, op)

    row = await operation(pool, op)
    assert (row["state"], row["remote_job_id"], row["reason_code"]) == ("rejected", None, "abandoned_by_operator")
    assert await accounting_rows(pool, op) == [(job, "created_after_decision")]
    assert late_count("rejected") == before + 1

    report = await streams_cli(settings, "accounting", "report", "--operation-prefix", op)
    assert report.exit_code == 0, report.stderr
    assert "created after a decision           1 (1 not observed: adopt or cancel each, docs/decisions.md)" in (
        report.stdout
    )
    assert f"  {op} (rejected): job {job}  -> streams operations adopt {op} {job} --reason ..." in report.stdout
    as_json = (await streams_cli(settings, "accounting", "report", "--operation-prefix", op, "--json")).json()
    assert as_json["jobs_by_learned_via"] == {"created_after_decision": 1}
    assert as_json["created_after_decision"] == {
        "jobs": 1,
        "unobserved": 1,
        "first": [{"operation_id": op, "remote_job_id": job, "state": "rejected"}],
    }

    # The corrective decision: adopt exactly that job (the provider knows it: one GET).
    gets_before = await gets(simulator)
    adopted = await streams_cli(
        settings, "operations", "adopt", op, job, "--reason", "its 201 came after the abandon", "--actor", "alice"
    )
    assert adopted.exit_code == 0, adopted.stderr
    assert adopted.stdout.strip().startswith(f"adopt: operation {op} rejected -> submitted (transition 5,")
    assert await gets(simulator) == gets_before + 1
    row = await operation(pool, op)
    assert (row["state"], row["remote_job_id"], row["reason_code"]) == (
        "submitted",
        job,
        ReasonCode.ADOPTED_AFTER_DECISION.value,
    )
    assert row["reason"].startswith(f"adopted job {job} created after the decision, the provider answers status ")
    assert row["reason"].endswith("(given: alice)): its 201 came after the abandon")
    moves = await pool.fetch("SELECT from_state::text, to_state::text FROM transitions WHERE operation_id=$1", op)
    assert [(m["from_state"], m["to_state"]) for m in moves][-2:] == [
        ("uncertain", "rejected"),
        ("rejected", "submitted"),
    ]
    after = (await streams_cli(settings, "accounting", "report", "--operation-prefix", op, "--json")).json()
    assert after["created_after_decision"] == {"jobs": 1, "unobserved": 0, "first": []}


async def test_rejected_to_submitted_is_refused_for_any_other_job(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, settings: Settings
) -> None:
    op = "op-late-2"
    job = await abandoned_with_a_late_answer(runtime, pool, op)
    other = (await runtime.remote.submit("op-late-2-other", request_text())).job_id
    before = await operation(pool, op)

    refused = await streams_cli(settings, "operations", "adopt", op, other, "--reason", "r", "--without-provider-check")
    assert refused.exit_code == 3, refused.stderr
    assert "it is rejected; adopt applies only to uncertain operations (or to this rejected one with the job " in (
        refused.stderr
    )
    assert f"created after its decision: {job})" in refused.stderr
    with pytest.raises(asyncpg.CheckViolationError, match="only a job created after the decision"):
        await pool.execute(
            "UPDATE operations SET state = 'submitted', remote_job_id = $2 WHERE operation_id = $1", op, other
        )
    plain = "op-late-3"  # rejected with no late job at all: the trigger refuses the move too
    ledger = Ledger(pool, "w")
    assert await ledger.accept(plain, request_text(), submitted_at_ms=1)
    fencing = await ledger.claim_for_submit(plain)
    assert fencing is not None
    assert await ledger.save_submission_without_job(plain, fencing, OperationState.REJECTED, "400", ReasonCode.REFUSED)
    with pytest.raises(asyncpg.CheckViolationError, match="only a job created after the decision"):
        await pool.execute(
            "UPDATE operations SET state = 'submitted', remote_job_id = $2 WHERE operation_id = $1", plain, job
        )
    assert await operation(pool, op) == before


async def uncertain(pool: asyncpg.Pool, op: str) -> None:
    ledger = Ledger(pool, "w")
    assert await ledger.accept(op, request_text(), submitted_at_ms=1)
    fencing = await ledger.claim_for_submit(op)
    assert fencing is not None
    assert await ledger.save_submission_without_job(
        op, fencing, OperationState.UNCERTAIN, "timed out after send", ReasonCode.UNKNOWN_OUTCOME
    )


async def test_adopt_asks_the_provider_and_refuses_a_job_it_does_not_know(
    pool: asyncpg.Pool, simulator: Simulator, settings: Settings
) -> None:
    op = "op-check-1"
    await uncertain(pool, op)
    before = await operation(pool, op)
    gets_before = await gets(simulator)
    refused = await streams_cli(settings, "operations", "adopt", op, "not-a-job", "--reason", "typed from a ticket")
    assert refused.exit_code == 3, refused.stderr
    assert "the provider answers 404 for job not-a-job: it does not know it" in refused.stderr
    assert "--without-provider-check" in refused.stderr and "nothing was written" in refused.stderr
    assert await gets(simulator) == gets_before + 1
    assert await operation(pool, op) == before
    assert await accounting_rows(pool, op) == []

    forced = await streams_cli(
        settings, "operations", "adopt", op, "not-a-job", "--reason", "console is down", "--without-provider-check"
    )
    assert forced.exit_code == 0, forced.stderr
    assert await gets(simulator) == gets_before + 1  # the override asks nothing
    row = await operation(pool, op)
    assert (row["state"], row["remote_job_id"]) == ("submitted", "not-a-job")
    assert "not checked at the provider (--without-provider-check)" in row["reason"]


async def test_adopt_of_a_job_the_provider_knows_records_its_answer(
    pool: asyncpg.Pool, simulator: Simulator, settings: Settings, remote: RemoteClient
) -> None:
    op = "op-check-2"
    await uncertain(pool, op)
    job = (await remote.submit(op, request_text())).job_id  # the job the uncertain POST created
    adopted = await streams_cli(settings, "operations", "adopt", op, job, "--reason", "found by client reference")
    assert adopted.exit_code == 0, adopted.stderr
    row = await operation(pool, op)
    assert (row["state"], row["remote_job_id"], row["reason_code"]) == ("submitted", job, "adopted_by_operator")
    assert row["reason"].startswith(f"adopted job {job}, the provider answers status ")
    assert await accounting_rows(pool, op) == [(job, "adopted")]


async def test_adopt_refuses_when_the_provider_cannot_be_asked(pool: asyncpg.Pool, settings: Settings) -> None:
    op = "op-check-3"
    await uncertain(pool, op)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    unreachable = settings.replace(remote_base_url=f"http://127.0.0.1:{port}")
    before = await operation(pool, op)
    refused = await streams_cli(unreachable, "operations", "adopt", op, "job-1", "--reason", "r")
    assert refused.exit_code == 3, refused.stderr
    assert "could not ask the provider about job job-1 (transient:" in refused.stderr
    assert await operation(pool, op) == before
