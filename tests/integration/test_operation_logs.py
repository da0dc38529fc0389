"""Log lines of the dispatcher, observer and reconciler on the real services carry the operation id, the remote
job id and the fencing value in force, and nothing of the event handled before."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
import orjson
import pytest

from streams import logs
from streams.model.codes import ReasonCode
from streams.model.states import OperationState
from streams.worker.app import handle_with_retries
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from streams.worker.stages.reconciler import Reconciler
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """Everything the ``streams`` loggers write while the test runs, as JSON lines."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("streams")
    saved = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(saved)


def records(stream: io.StringIO, name: str) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, stream.getvalue().splitlines()) if r["logger"] == name]


def submission(op: str) -> RawMessage:
    value = {"operation_id": op, "request": {"input": {"prompt": "hello", "max_tokens": 5}}, "submitted_at_ms": 1}
    return RawMessage("generation.submissions", 0, 1, op.encode(), orjson.dumps(value))


async def test_dispatcher_lines_name_operation_and_fencing_value(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, json_lines: io.StringIO
) -> None:
    await simulator.configure(fault_5xx=1.0)
    dispatcher = Dispatcher(runtime)
    await handle_with_retries(runtime, dispatcher.handle, submission("op-log-1"))
    # then bad input: its dead-letter line must not carry the previous event's operation
    bad = RawMessage("generation.submissions", 0, 2, b"k", b"not json")
    await handle_with_retries(runtime, dispatcher.handle, bad)

    fencing = await pool.fetchval("SELECT fencing_token FROM operations WHERE operation_id = 'op-log-1'")
    (post,) = records(json_lines, "streams.worker.stages.dispatcher")
    assert "POST unknown_outcome" in post["message"]
    assert (post["operation_id"], post["fencing_token"]) == ("op-log-1", fencing) and "remote_job_id" not in post
    (dead,) = records(json_lines, "streams.worker.runtime")
    assert "dead-letter" in dead["message"] and not {"operation_id", "fencing_token"} & set(dead)


async def test_observer_lines_name_operation_job_and_fencing_value(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, json_lines: io.StringIO
) -> None:
    op = "op-log-2"
    assert await runtime.ledger.accept(op, '{"input": {"prompt": "hi", "max_tokens": 1}}', submitted_at_ms=1)
    fencing = await runtime.ledger.claim_for_submit(op)
    assert fencing is not None
    assert await runtime.ledger.save_submitted(op, fencing, "job-unknown-to-provider", 0.0, None)
    (poll,) = [p for p in await runtime.ledger.claim_due_polls(10, 3.0) if p.operation_id == op]
    value = {
        "operation_id": op,
        "remote_job_id": poll.remote_job_id,
        "poll_claim_id": poll.poll_claim_id,
        "claimed_at_ms": int(time.time() * 1000),
    }
    await handle_with_retries(
        runtime, Observer(runtime).handle, RawMessage("generation.polls", 0, 0, op.encode(), orjson.dumps(value))
    )

    claimed = await pool.fetchval("SELECT fencing_token FROM operations WHERE operation_id = $1", op)
    assert claimed == fencing + 1
    lines = records(json_lines, "streams.worker.stages.observer")
    assert lines, "the 404 is logged"
    for line in lines:
        assert (line["operation_id"], line["remote_job_id"], line["fencing_token"]) == (
            op,
            "job-unknown-to-provider",
            claimed,
        )


async def test_reconciler_lines_name_operation_job_and_fencing_value(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, json_lines: io.StringIO
) -> None:
    request = '{"input": {"prompt": "hi", "max_tokens": 1}}'
    for op, posts in (("op-log-3", 1), ("op-log-4", 0)):  # one job to adopt, one operation with none
        assert await runtime.ledger.accept(op, request, submitted_at_ms=1)
        fencing = await runtime.ledger.claim_for_submit(op)
        assert fencing is not None
        for _ in range(posts):
            await runtime.remote.submit(op, request)
        assert await runtime.ledger.save_submission_without_job(
            op, fencing, OperationState.UNCERTAIN, "lost", ReasonCode.UNKNOWN_OUTCOME
        )
    await simulator.configure(lookup_enabled=True, lookup_lag_s=0.05)
    runtime.settings = runtime.settings.replace(lookup_enabled=True, lookup_lag_s=0.2)
    reconciler = Reconciler(runtime)

    async def both_looked_up() -> bool:
        await reconciler.tick()
        return len(records(json_lines, "streams.worker.stages.reconciler")) == 2

    await wait_for(both_looked_up, 15, "both lookups to be logged")
    lines = {line["operation_id"]: line for line in records(json_lines, "streams.worker.stages.reconciler")}
    adopted = await pool.fetchrow("SELECT remote_job_id, fencing_token FROM operations WHERE operation_id='op-log-3'")
    assert "adopted job" in lines["op-log-3"]["message"]
    assert (lines["op-log-3"]["remote_job_id"], lines["op-log-3"]["fencing_token"]) == tuple(adopted.values())
    left = await pool.fetchval("SELECT fencing_token FROM operations WHERE operation_id='op-log-4'")
    assert "not found by lookup" in lines["op-log-4"]["message"] and "remote_job_id" not in lines["op-log-4"]
    assert lines["op-log-4"]["fencing_token"] == left


async def test_redispatch_lines_name_the_operation(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, json_lines: io.StringIO
) -> None:
    request = '{"input": {"prompt": "hi", "max_tokens": 1}}'
    assert await runtime.ledger.accept("op-log-5", request, submitted_at_ms=1)  # left accepted
    await simulator.configure(fault_5xx=1.0)
    # The scheduler starts one task per operation to re-dispatch; nothing is bound in the task that starts it.
    assert await asyncio.create_task(Dispatcher(runtime).redispatch("op-log-5", request))
    fencing = await pool.fetchval("SELECT fencing_token FROM operations WHERE operation_id = 'op-log-5'")
    lines = records(json_lines, "streams.worker.stages.dispatcher")
    assert len(lines) == 2 and all(line["operation_id"] == "op-log-5" for line in lines)
    (post,) = [line for line in lines if "POST unknown_outcome" in line["message"]]
    assert post["fencing_token"] == fencing
