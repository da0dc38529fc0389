"""Helpers of the integration tests of stalled and uncertain operations: real ledger, simulator and observer."""

from __future__ import annotations

import time
from typing import Any

import asyncpg
import orjson

from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.observer import Observer
from tests.support import SimulatorServer

POLLABLE = "('submitted', 'queued', 'running')"


def request_text(max_tokens: int = 5, prompt_words: int = 10) -> str:
    """A provider request (JSON text) asking for ``max_tokens`` tokens after a prompt of about ``prompt_words``."""
    prompt = " ".join(["lease"] * prompt_words)
    return f'{{"input": {{"prompt": "{prompt}", "max_tokens": {max_tokens}}}}}'


async def submitted_operation(runtime: Runtime, op: str, generated: int = 5) -> str:
    """An operation with a real remote job (created through the product's POST), saved as submitted and due
    now; returns the job id."""
    request = request_text(generated)
    assert await runtime.ledger.accept(op, request, submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit(op)
    assert fencing is not None
    result = await runtime.remote.submit(op, request)
    assert await runtime.ledger.save_submitted(op, fencing, result.job_id, 0.0, None)
    return result.job_id


async def poll_now(runtime: Runtime, pool: asyncpg.Pool, op: str) -> bool:
    """Make the operation due, claim its poll like the scheduler and handle it like the observer agent.

    Returns False when nothing was claimed (the operation is not pollable).
    """
    await pool.execute(f"UPDATE operations SET next_poll_at = now() WHERE operation_id=$1 AND state IN {POLLABLE}", op)
    polls = [p for p in await runtime.ledger.claim_due_polls(100, 3.0) if p.operation_id == op]
    if not polls:
        return False
    value = {
        "operation_id": op,
        "remote_job_id": polls[0].remote_job_id,
        "poll_claim_id": polls[0].poll_claim_id,
        "claimed_at_ms": int(time.time() * 1000),
    }
    await Observer(runtime).handle(RawMessage("generation.polls", 0, 0, op.encode(), orjson.dumps(value)))
    return True


async def operation(pool: asyncpg.Pool, op: str) -> dict[str, Any]:
    row = await pool.fetchrow("SELECT *, state::text AS state FROM operations WHERE operation_id=$1", op)
    assert row is not None
    return dict(row)


async def sim_job(simulator: SimulatorServer, op: str, index: int = 0) -> dict[str, Any]:
    jobs: list[dict[str, Any]] = (await simulator.get(f"/_sim/operations/{op}"))["jobs"]
    return jobs[index]


async def transitions(pool: asyncpg.Pool, op: str) -> list[tuple[int, str | None, str]]:
    rows = await pool.fetch(
        "SELECT seq, from_state::text, to_state::text FROM transitions WHERE operation_id=$1 ORDER BY id", op
    )
    return [(r["seq"], r["from_state"], r["to_state"]) for r in rows]
