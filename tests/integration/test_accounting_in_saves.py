"""The accounting of POSTs and GETs written by the saves they lead to, on the real PostgreSQL, dispatcher, observer
and simulator: one statement per saved job id or observation (no separate accounting statement), and exactly one
``remote_calls`` row per call in every path (saved, refused by fencing, unstorable, a failed GET, a lost lease)."""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import orjson
import pytest

from streams.config import lease_key
from streams.errors import LedgerDataError
from streams.ledger.records import RemoteCall, SaveOutcome
from streams.ledger.sql import Query
from streams.model.answers import JobSnapshot
from streams.model.codes import RemoteCallOutcome as Outcome
from streams.model.states import OperationState as S
from streams.worker.runtime import Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from tests.integration.test_accounting import submission
from tests.integration.test_observer import claim_poll, submitted_operation
from tests.support import SimulatorServer as Simulator

pytestmark = pytest.mark.integration

CALLS = """
    SELECT method, status_code, outcome, remote_job_id, fencing_token, worker, duration_ms > 0 AS timed
    FROM remote_calls WHERE operation_id = $1 ORDER BY id"""


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Every ledger statement sent from now on, counted by query name (each goes through one ``Query`` method)."""
    sent: collections.Counter[str] = collections.Counter()
    for method in ("fetch", "fetchrow", "fetchval", "execute"):
        real = getattr(Query, method)

        def counting(real: Any) -> Any:
            async def call(self: Query, db: Any, /, **values: Any) -> Any:
                sent[self.name] += 1
                return await real(self, db, **values)

            return call

        monkeypatch.setattr(Query, method, counting(real))
    yield sent


async def calls(pool: asyncpg.Pool, op: str) -> list[tuple[Any, ...]]:
    return [tuple(r.values()) for r in await pool.fetch(CALLS, op)]


async def test_a_post_is_accounted_by_its_job_id_save(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, statements: collections.Counter[str]
) -> None:
    await Dispatcher(runtime).handle(submission("op-2xx"))
    await simulator.configure(fault_502_job_id=1.0)
    await Dispatcher(runtime).handle(submission("op-502"))
    assert (statements["save_submitted"], statements["record_remote_call"]) == (2, 0)
    expected = (("op-2xx", 201, "created", "post_2xx"), ("op-502", 502, "created_via_502", "post_502"))
    for op, status, outcome, via in expected:
        job = (await simulator.get(f"/_sim/operations/{op}"))["jobs"][0]["job_id"]
        assert await calls(pool, op) == [("POST", status, outcome, job, 1, "test-worker", True)]
        row = await pool.fetchrow("SELECT remote_job_id, learned_via FROM remote_jobs WHERE operation_id = $1", op)
        assert row is not None and tuple(row.values()) == (job, via)


async def test_an_observed_poll_is_accounted_by_its_save_in_one_statement(
    runtime: Runtime, pool: asyncpg.Pool, statements: collections.Counter[str]
) -> None:
    job_id = await submitted_operation(runtime, "op-get")
    poll = await claim_poll(runtime, "op-get")
    statements.clear()
    await Observer(runtime).handle(poll)
    assert statements == {"claim_for_observe": 1, "save_observation": 1}  # no accounting statement of its own
    row = await pool.fetchrow("SELECT state::text, fencing_token FROM operations WHERE operation_id = 'op-get'")
    assert row is not None and tuple(row.values()) == ("succeeded", 2)  # the simulator's jobs end at once
    assert await calls(pool, "op-get") == [("GET", 200, "succeeded", job_id, 2, "test-worker", True)]


async def test_a_save_refused_by_fencing_still_writes_its_call_once(runtime: Runtime, pool: asyncpg.Pool) -> None:
    job_id = await submitted_operation(runtime, "op-fence")
    poll_claim_id = orjson.loads((await claim_poll(runtime, "op-fence")).value or b"")["poll_claim_id"]
    first = await runtime.ledger.claim_for_observe("op-fence", poll_claim_id)
    assert first is not None
    assert await runtime.ledger.reschedule_poll("op-fence", poll_claim_id, 0.0)
    again = orjson.loads((await claim_poll(runtime, "op-fence")).value or b"")["poll_claim_id"]
    assert await runtime.ledger.claim_for_observe("op-fence", again) is not None  # a newer claim
    call = RemoteCall("op-fence", "GET", 200, Outcome.RUNNING, job_id, 4.5, first.fencing_token)
    running = JobSnapshot(job_id, "running", S.RUNNING)
    for _ in range(2):  # the same save sent again (its reply lost): the same call, one row
        saved = await runtime.ledger.save_observation("op-fence", first.fencing_token, running, 1.0, call)
        assert saved is SaveOutcome.REFUSED_FENCING
    assert await calls(pool, "op-fence") == [("GET", 200, "running", job_id, 2, "test-worker", True)]
    # a POST whose job-id save is refused (stale fencing value): its row and its job's record, as before
    assert await runtime.ledger.accept("op-late", "{}", submitted_at_ms=0)
    assert await runtime.ledger.claim_for_submit("op-late") == 1
    post = RemoteCall("op-late", "POST", 201, Outcome.CREATED, "job-late", 7.0, 0)
    assert not await runtime.ledger.save_submitted("op-late", 0, "job-late", 1.0, None, post)
    assert await calls(pool, "op-late") == [("POST", 201, "created", "job-late", 0, "test-worker", True)]
    learned = await pool.fetchval("SELECT learned_via FROM remote_jobs WHERE remote_job_id = 'job-late'")
    assert learned == "post_2xx"
    assert await pool.fetchval("SELECT remote_job_id FROM operations WHERE operation_id = 'op-late'") is None


async def test_a_call_that_is_not_the_saves_own_is_refused(runtime: Runtime) -> None:
    other = RemoteCall("op-x", "GET", 200, Outcome.RUNNING, "job-x", 1.0, 3)
    with pytest.raises(ValueError, match="not the GET of this save"):
        await runtime.ledger.save_observation("op-x", 2, JobSnapshot("job-x", "running", S.RUNNING), 1.0, other)
    with pytest.raises(ValueError, match="not the POST of this save"):
        await runtime.ledger.save_submitted("op-x", 3, "job-x", 1.0, None, other)


async def test_an_unstorable_answer_records_its_get_once(
    runtime: Runtime, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch, statements: collections.Counter[str]
) -> None:
    job_id = await submitted_operation(runtime, "op-nul")
    poll = await claim_poll(runtime, "op-nul")
    answer = JobSnapshot(
        job_id, "succeeded", S.SUCCEEDED, outputs=[{"id": "o1", "text": "a\x00b"}], completed_at_ms=1, status_code=200
    )

    async def observe(operation_id: str, remote_job_id: str) -> JobSnapshot:
        return answer

    monkeypatch.setattr(runtime.remote, "observe", observe)
    statements.clear()
    await Observer(runtime).handle(poll)
    row = await pool.fetchrow("SELECT state::text, reason FROM operations WHERE operation_id = 'op-nul'")
    assert row is not None and row["state"] == "failed" and "unstorable_response" in row["reason"]
    assert await calls(pool, "op-nul") == [("GET", 200, "succeeded", job_id, 2, "test-worker", False)]
    assert statements["record_remote_call"] == 1  # the refused save wrote nothing: the call by itself


async def test_a_failed_get_and_a_lost_lease_record_their_call_once(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = await submitted_operation(runtime, "op-lost")
    poll_claim_id = orjson.loads((await claim_poll(runtime, "op-lost")).value or b"")["poll_claim_id"]
    key = lease_key(runtime.settings, "observe", "op-lost")
    lease = await runtime.leases.acquire(key)
    assert lease is not None
    real_observe = runtime.remote.observe

    async def observe_then_lose_ownership(operation_id: str, remote_job_id: str) -> JobSnapshot:
        snapshot = await real_observe(operation_id, remote_job_id)
        await runtime.leases.client.set(key, "someone-else", px=5000)  # the lease changed hands meanwhile
        return snapshot

    monkeypatch.setattr(runtime.remote, "observe", observe_then_lose_ownership)
    claim = await runtime.ledger.claim_for_observe("op-lost", poll_claim_id)
    assert claim is not None
    await Observer(runtime)._observe("op-lost", poll_claim_id, claim, lease)
    assert await pool.fetchval("SELECT poll_count FROM operations WHERE operation_id = 'op-lost'") == 0  # not saved
    assert await calls(pool, "op-lost") == [("GET", 200, "succeeded", job_id, 2, "test-worker", True)]

    await simulator.configure(fault_unknown_status=1.0)
    failed_job = await submitted_operation(runtime, "op-unknown")
    await Observer(runtime).handle(await claim_poll(runtime, "op-unknown"))
    assert [c[:5] for c in await calls(pool, "op-unknown")] == [("GET", 200, "unknown_status", failed_job, 2)]
    assert uuid.UUID(str(await pool.fetchval("SELECT call_id FROM remote_calls WHERE operation_id = 'op-unknown'")))


async def test_a_batch_refused_for_one_value_writes_the_others_calls_and_not_its_own(
    runtime: Runtime, pool: asyncpg.Pool, statements: collections.Counter[str]
) -> None:
    ops = ["op-b1", "op-b2", "op-b3"]
    claims = {}
    for op in ops:
        await submitted_operation(runtime, op)
        poll_claim_id = orjson.loads((await claim_poll(runtime, op)).value or b"")["poll_claim_id"]
        claim = await runtime.ledger.claim_for_observe(op, poll_claim_id)
        assert claim is not None
        claims[op] = claim
    bad = {"id": "o1", "text": "a\x00b"}

    async def save(op: str) -> SaveOutcome | str:
        claim = claims[op]
        outputs = [bad] if op == "op-b2" else [{"id": "o1"}]
        answer = JobSnapshot(claim.remote_job_id, "succeeded", S.SUCCEEDED, outputs=outputs, completed_at_ms=1)
        call = RemoteCall(op, "GET", 200, Outcome.SUCCEEDED, claim.remote_job_id, 2.0, claim.fencing_token)
        try:
            return await runtime.ledger.save_observation(op, claim.fencing_token, answer, None, call)
        except LedgerDataError:
            return "refused"

    statements.clear()
    assert await asyncio.gather(*(save(op) for op in ops)) == [SaveOutcome.SAVED, "refused", SaveOutcome.SAVED]
    assert statements["record_remote_call"] == 0  # the observer's fallback, not the ledger's, records the refused one
    for op in ops:
        job = claims[op].remote_job_id
        expected = [] if op == "op-b2" else [("GET", 200, "succeeded", job, 2, "test-worker", True)]
        assert await calls(pool, op) == expected, op
