"""A worker stopped with SIGTERM after real work closes its clients: no connection or HTTP session is left for the
interpreter to report at exit."""

from __future__ import annotations

import signal
import uuid

import asyncpg
import pytest

from streams.clients.submit import SubmissionProducer
from streams_harness.fleet import Fleet
from tests.support import provider_request, wait_for

pytestmark = pytest.mark.e2e


async def test_sigterm_after_work_leaves_nothing_unclosed(
    fleet: Fleet, producer: SubmissionProducer, ledger_pool: asyncpg.Pool
) -> None:
    worker = fleet.start("a")
    await fleet.wait_ready("a")
    prefix = f"stop{uuid.uuid4().hex[:6]}"
    for i in range(3):
        await (await producer.submit(f"{prefix}-{i}", provider_request(10, 5)))

    async def done() -> bool:
        n = await ledger_pool.fetchval(
            "SELECT count(*) FROM operations WHERE operation_id LIKE $1 AND state = 'succeeded'", prefix + "%"
        )
        return bool(n == 3)

    await wait_for(done, 60, "three operations to succeed (POSTs and GETs made)")
    worker.signal(signal.SIGTERM)
    assert worker.proc.wait(30) == 0
    log = worker.log_text()
    assert "Worker]: Stopping" in log
    assert "Unclosed" not in log
