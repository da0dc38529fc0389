"""Answers that stop making progress, against the real simulator and ledger: the 404 grace window, unknown
statuses, a job that never finishes (each ends ``stalled``, polling stops, GETs bounded) and a status that goes
back (never regresses the saved state)."""

from __future__ import annotations

import asyncpg
import orjson
import pytest

from streams.clients.follow import read_topic_to_end
from streams.ledger.records import SaveOutcome
from streams.model.answers import JobSnapshot
from streams.model.codes import ReasonCode
from streams.model.states import OperationState
from streams.worker.runtime import Runtime
from streams.worker.stages.relay import OutboxRelay
from tests.integration.stuck import (
    operation,
    poll_now,
    request_text,
    sim_job,
    submitted_operation,
    transitions,
)
from tests.support import SimulatorServer as Simulator
from tests.support import real_ledger, wait_for


async def grace_passed(pool: asyncpg.Pool, op: str, grace_s: float) -> bool:
    """True once more than ``grace_s`` passed since the job id of ``op`` was saved, by the database's clock
    (the one the 404 rule reads)."""
    return bool(
        await pool.fetchval(
            "SELECT remote_job_id_saved_at < now() - make_interval(secs => $2) FROM operations WHERE operation_id = $1",
            op,
            grace_s,
        )
    )


pytestmark = pytest.mark.integration


async def test_404_inside_the_grace_window_only_reschedules(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await simulator.configure(fault_not_found=1.0, not_found_window_s=60.0)
    runtime.settings = runtime.settings.replace(not_found_grace_s=60.0)
    job_id = await submitted_operation(runtime, "op-404-in")
    for _ in range(3):
        assert await poll_now(runtime, pool, "op-404-in")
    row = await operation(pool, "op-404-in")
    assert row["state"] == "submitted" and row["next_poll_at"] is not None
    assert row["poll_count"] == 3  # each 404 counts, so the backoff grows
    job = await sim_job(simulator, "op-404-in")
    assert (job["job_id"], job["gets"], job["gets_not_found"]) == (job_id, 3, 3)
    assert [t[2] for t in await transitions(pool, "op-404-in")] == ["accepted", "submitting", "submitted"]


async def test_404_window_shorter_than_the_grace_ends_observed_as_usual(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await simulator.configure(fault_not_found=1.0, not_found_window_s=0.3)
    runtime.settings = runtime.settings.replace(not_found_grace_s=30.0)
    await submitted_operation(runtime, "op-404-short")

    async def succeeded() -> bool:
        await poll_now(runtime, pool, "op-404-short")
        state: str = (await operation(pool, "op-404-short"))["state"]
        return state == "succeeded"

    await wait_for(succeeded, 15, "the job to be observed past its 404 window")
    assert (await sim_job(simulator, "op-404-short"))["gets_not_found"] >= 1


async def test_404_past_the_grace_window_stalls_with_reason_and_raw_answer_and_stops_polling(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await simulator.configure(fault_not_found=1.0, not_found_window_s=60.0)
    runtime.settings = runtime.settings.replace(not_found_grace_s=0.3)
    await submitted_operation(runtime, "op-404-out")
    assert await poll_now(runtime, pool, "op-404-out")
    assert (await operation(pool, "op-404-out"))["state"] == "submitted"  # still inside the window
    await wait_for(lambda: grace_passed(pool, "op-404-out", 0.3), 5, "the 0.3 s grace window to pass")
    assert await poll_now(runtime, pool, "op-404-out")
    row = await operation(pool, "op-404-out")
    assert row["state"] == "stalled" and row["next_poll_at"] is None
    assert row["reason_code"] == "job_not_found"
    assert row["reason"].startswith("not found (404) more than 0 s after the job id was saved; remote job job_")
    assert row["last_observation"]["http_status"] == 404
    assert orjson.loads(row["last_observation"]["body"])["error"]["code"] == "not_found"
    assert not await poll_now(runtime, pool, "op-404-out")  # nothing polls a stalled operation
    assert (await sim_job(simulator, "op-404-out"))["gets"] == 2
    assert [t[1:] for t in await transitions(pool, "op-404-out")][-1] == ("submitted", "stalled")


@pytest.mark.parametrize("limit", [1, 5])
async def test_an_unknown_status_n_times_in_a_row_stalls_after_exactly_n_gets(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, limit: int
) -> None:
    await simulator.configure(fault_unknown_status=1.0)
    runtime.settings = runtime.settings.replace(unknown_status_limit=limit)
    op = f"op-unknown-{limit}"
    await submitted_operation(runtime, op)
    for i in range(limit):
        assert await poll_now(runtime, pool, op)
        row = await operation(pool, op)
        assert row["unknown_status_count"] == i + 1
        assert row["state"] == ("stalled" if i + 1 == limit else "submitted")
    assert not await poll_now(runtime, pool, op)
    job = await sim_job(simulator, op)
    assert job["gets"] == limit  # bounded by the setting
    row = await operation(pool, op)
    answered = orjson.loads(row["last_observation"]["body"])["status"]
    assert answered == job["unknown_status"] and answered in ("aborted", "paused", None)
    assert row["reason_code"] == "unknown_status"
    assert row["reason"].startswith(f"a status this client does not know, {limit} times in a row; remote job job_")


async def test_a_known_status_ends_a_run_of_unknown_ones(runtime: Runtime, pool: asyncpg.Pool) -> None:
    runtime.settings = runtime.settings.replace(unknown_status_limit=3)
    ledger = runtime.ledger
    assert await ledger.accept("op-reset", request_text(), submitted_at_ms=0)
    fencing = await ledger.claim_for_submit("op-reset")
    assert fencing is not None and await ledger.save_submitted("op-reset", fencing, "job-reset", 0.0, None)
    answer = {"http_status": 200, "body": '{"status": "paused"}'}
    assert await ledger.note_poll_setback("op-reset", fencing, ReasonCode.UNKNOWN_STATUS, 3, 0.1, "r", answer) == (
        OperationState.SUBMITTED,
        1,
    )
    assert await ledger.note_poll_setback("op-reset", fencing, ReasonCode.UNKNOWN_STATUS, 3, 0.1, "r", answer) == (
        OperationState.SUBMITTED,
        2,
    )
    running = JobSnapshot(job_id="job-reset", status="running", state=OperationState.RUNNING)
    assert await ledger.save_observation("op-reset", fencing, running, 0.1) is SaveOutcome.SAVED
    assert (await operation(pool, "op-reset"))["unknown_status_count"] == 0
    assert await ledger.note_poll_setback("op-reset", fencing, ReasonCode.UNKNOWN_STATUS, 3, 0.1, "r", answer) == (
        OperationState.RUNNING,
        1,
    )
    assert (
        await ledger.note_poll_setback("op-reset", fencing - 1, ReasonCode.UNKNOWN_STATUS, 3, 0.1, "r", answer) is None
    )  # fenced


async def test_a_job_that_never_finishes_stalls_at_the_maximum_age_with_gets_bounded(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await simulator.configure(fault_never_finishes=1.0)
    runtime.settings = runtime.settings.replace(max_observation_age_s=1.0)
    await submitted_operation(runtime, "op-forever")

    async def stalled() -> bool:
        await poll_now(runtime, pool, "op-forever")
        state: str = (await operation(pool, "op-forever"))["state"]
        return state == "stalled"

    await wait_for(stalled, 10, "the job to stall at the maximum observation age")
    row = await operation(pool, "op-forever")
    assert row["reason_code"] == "max_age"
    assert row["reason"].startswith("observed for more than 1 s without becoming terminal; remote job job_")
    assert row["last_observation"]["status"] == "running"  # the last answer, kept
    gets = (await sim_job(simulator, "op-forever"))["gets"]
    assert not await poll_now(runtime, pool, "op-forever")
    assert (await sim_job(simulator, "op-forever"))["gets"] == gets  # polling stopped
    assert [t[2] for t in await transitions(pool, "op-forever")][-2:] == ["running", "stalled"]


async def test_a_status_that_goes_back_never_regresses_the_saved_state(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await simulator.configure(fault_status_regression=1.0, compression=5.0)  # ~1 s running: several GETs
    await submitted_operation(runtime, "op-regress", generated=200)
    saved_states: list[str] = []

    async def succeeded() -> bool:
        await poll_now(runtime, pool, "op-regress")
        saved_states.append((await operation(pool, "op-regress"))["state"])
        return saved_states[-1] == "succeeded"

    await wait_for(succeeded, 20, "the job to succeed")
    job = await sim_job(simulator, "op-regress")
    assert job["regressed_gets"] >= 1  # the simulator did answer queued after running
    assert "running" in saved_states
    assert "queued" not in saved_states[saved_states.index("running") :]
    # the transition log: forward only, queued (if seen at all) before running, never after it (the trigger would
    # refuse an illegal step outright; this checks which legal steps were taken)
    to_states = [b for _, _, b in await transitions(pool, "op-regress")]
    assert to_states in (
        ["accepted", "submitting", "submitted", "running", "succeeded"],
        ["accepted", "submitting", "submitted", "queued", "running", "succeeded"],
    ), to_states


async def test_a_state_entered_twice_reaches_generation_transitions_with_distinct_event_ids(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await simulator.configure(fault_unknown_status=1.0)
    runtime.settings = runtime.settings.replace(unknown_status_limit=1)
    await submitted_operation(runtime, "op-pub")
    assert await poll_now(runtime, pool, "op-pub")
    await real_ledger(runtime).repoll("op-pub", "alice")
    assert await poll_now(runtime, pool, "op-pub")  # stalls again: a state entered twice
    assert await OutboxRelay(runtime).tick() == 6  # accepted, submitting, submitted, stalled, submitted, stalled
    events = [r.value for r in await read_topic_to_end(runtime.settings, "transitions")]
    mine = [e for e in events if e["operation_id"] == "op-pub"]
    assert [(e["event_id"], e["from_state"], e["to_state"]) for e in mine][-3:] == [
        ("transition:op-pub:4:stalled", "submitted", "stalled"),
        ("transition:op-pub:5:submitted", "stalled", "submitted"),
        ("transition:op-pub:6:stalled", "submitted", "stalled"),
    ]
    assert mine[-1]["seq"] == 6 and "times in a row" in mine[-1]["reason"]
