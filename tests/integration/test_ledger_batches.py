"""The ledger's batched statements on the real PostgreSQL: a batch gives every request exactly what its own
statement gives (results, and every row written: states, fencing values, transitions and their event ids,
outputs, outbox, accounting), bad values and repeats of one operation inside a batch, two batches locking the
same operations in opposite orders, a deadlock, and the round trips saved."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from prometheus_client import REGISTRY

from streams.config import Settings
from streams.errors import LedgerDataError, LedgerUnavailableError
from streams.ledger import batching as ledger_module
from streams.ledger import store as store_module
from streams.ledger.batching import WAIT_FOR_LOCKS
from streams.ledger.pool import _init_connection, create_pool
from streams.ledger.records import ObserveClaim, RemoteCall, SaveOutcome
from streams.ledger.sql import LEDGER as Q
from streams.ledger.store import Ledger
from streams.model.answers import JobSnapshot
from streams.model.codes import ReasonCode
from streams.model.codes import RemoteCallOutcome as Outcome
from streams.model.states import OperationState as S
from tests.support import ReplyCutter, wait_for

pytestmark = pytest.mark.integration

REQUEST = '{"input": {"prompt": "p", "max_tokens": 2}, "n": 18446744073709551617}'

#: The batched statements, by the ledger's stage names.
STAGE_QUERIES = {
    "accept": Q.accept_operation.sql,
    "claim_submit": Q.claim_for_submit.sql,
    "save_submitted": Q.save_submitted.sql,
    "claim_observe": Q.claim_for_observe.sql,
    "reschedule_poll": Q.reschedule_poll.sql,
    "save_observation": Q.save_observation.sql,
    "record_remote_call": Q.record_remote_call.sql,
}


def no_calls(n: int, *, job: bool) -> dict[str, list[None]]:
    """The accounting arrays of ``n`` saves that carry no remote call (``job``: with the calls' job ids, as
    save_observation takes them)."""
    names = ["call_ids", "call_status_codes", "call_outcomes", "call_durations_ms"]
    return {name: [None] * n for name in names + (["call_remote_job_ids"] if job else [])}


@dataclass
class Logged:
    """A pool whose connections log every statement they send (asyncpg's query logger)."""

    pool: asyncpg.Pool
    queries: list[str] = field(default_factory=list)

    async def sent(self, stage: str) -> int:
        """Statements of ``stage`` sent so far (the logger reports on the next pass of the loop)."""
        await asyncio.sleep(0)
        return sum(1 for q in self.queries if q == STAGE_QUERIES[stage])


@pytest.fixture
async def logged(pool: asyncpg.Pool, migrated: Settings) -> AsyncIterator[Logged]:
    """A second pool on the test database (after ``pool`` emptied the tables), every statement logged."""
    holder = Logged(None)

    async def init(conn: asyncpg.Connection) -> None:
        await _init_connection(conn)
        conn.add_query_logger(lambda record: holder.queries.append(record.query))

    holder.pool = await asyncpg.create_pool(migrated.database_url.get_secret_value(), min_size=1, max_size=4, init=init)
    yield holder
    await holder.pool.close()


def succeeded(job: str, p: str) -> JobSnapshot:
    outputs = [{"id": "o1", "text": "first", "seed": 2**70}, {"id": "o2", "text": "second", "score": 0.1}]
    charge = {"id": f"{p}ch", "amount": "0.00125", "currency": "USD"}
    return JobSnapshot(job, "succeeded", S.SUCCEEDED, outputs=outputs, completed_at_ms=1_700_000_000_250, charge=charge)


def failed(job: str, p: str) -> JobSnapshot:
    charge = {"id": f"{p}ch2", "amount": "0.5", "currency": "USD"}
    refund = {"id": f"{p}rf", "amount": "0.5", "currency": "USD"}
    error = {"code": "model_error", "message": "no"}
    return JobSnapshot(
        job, "failed", S.FAILED, completed_at_ms=1_700_000_001_000, error=error, charge=charge, refund=refund
    )


async def submitted(ledger: Ledger, op: str, *, delay_s: float = 0.0) -> None:
    """``op`` accepted, claimed and saved with job ``<op>-job``, due ``delay_s`` from now."""
    assert await ledger.accept(op, REQUEST, submitted_at_ms=1)
    fencing = await ledger.claim_for_submit(op)
    assert fencing is not None
    assert await ledger.save_submitted(op, fencing, f"{op}-job", delay_s, None)


async def polled(ledger: Ledger, ops: list[str]) -> dict[str, int]:
    """Claim the due polls of ``ops`` as the scheduler does; their poll claim ids."""
    claims = {p.operation_id: p.poll_claim_id for p in await ledger.claim_due_polls(1000, 3600.0)}
    return {op: claims[op] for op in ops}


async def observed(ledger: Ledger, op: str) -> int:
    """``op`` submitted, its poll claimed, and claimed for observing; the fencing value."""
    await submitted(ledger, op)
    poll_claim_id = (await polled(ledger, [op]))[op]
    claim = await ledger.claim_for_observe(op, poll_claim_id)
    assert claim is not None
    return claim.fencing_token


async def observed_again(ledger: Ledger, op: str) -> int:
    """A newer observer claim of ``op``, observed already: its poll rescheduled due now, claimed again by the
    scheduler and claimed for observing (a poll claim is observed once); the new fencing value."""
    row = await ledger.get_operation(op)
    assert row is not None
    assert await ledger.reschedule_poll(op, row["poll_claim_id"], 0.0)
    poll_claim_id = (await polled(ledger, [op]))[op]
    claim = await ledger.claim_for_observe(op, poll_claim_id)
    assert claim is not None
    return claim.fencing_token


Call = Callable[[], Awaitable[Any]]


async def scenario(ledger: Ledger, p: str) -> list[Call]:
    """One copy of the scenario (operation ids prefixed with ``p``): its operations set up through ``ledger``, and
    the requests of every batched kind, each against its own operation; a mix of what succeeds and what each kind
    refuses (fencing, state order, stale claims, unknown operations)."""
    assert await ledger.accept(f"{p}acc-old", REQUEST, submitted_at_ms=1)
    for op in ("sub-ok", "sub-past", "job-ok", "job-502", "job-stale", "acct"):
        assert await ledger.accept(f"{p}{op}", REQUEST, submitted_at_ms=1)
    assert await ledger.claim_for_submit(f"{p}sub-past") == 1
    for op in ("job-ok", "job-502", "job-stale"):
        assert await ledger.claim_for_submit(f"{p}{op}") == 1
    for op in ("claim-ok", "claim-stale", "resched-ok", "resched-stale"):
        await submitted(ledger, f"{p}{op}")
    pc = await polled(ledger, [f"{p}{op}" for op in ("claim-ok", "claim-stale", "resched-ok", "resched-stale")])
    fence: dict[str, int] = {}
    for op in ("save-succ", "save-failed", "save-running", "save-fence", "save-order"):
        fence[op] = await observed(ledger, f"{p}{op}")
    await observed_again(ledger, f"{p}save-fence")  # a newer claim: fence["save-fence"] is stale
    order_job = f"{p}save-order-job"
    assert await ledger.save_observation(f"{p}save-order", fence["save-order"], succeeded(order_job, p), None) == (
        SaveOutcome.SAVED
    )

    def job(op: str) -> str:
        return f"{p}{op}-job"

    return [
        lambda: ledger.accept(f"{p}acc-new", REQUEST, submitted_at_ms=7, source_text='{"a": [1, 2.50]}'),
        lambda: ledger.accept(f"{p}acc-old", REQUEST, submitted_at_ms=7),
        lambda: ledger.claim_for_submit(f"{p}sub-ok"),
        lambda: ledger.claim_for_submit(f"{p}sub-past"),
        lambda: ledger.claim_for_submit(f"{p}sub-unknown"),
        lambda: ledger.save_submitted(f"{p}job-ok", 1, job("job-ok"), 0.0, None),
        lambda: ledger.save_submitted(f"{p}job-502", 1, job("job-502"), 900.0, "job id from HTTP 502 error.job_id"),
        lambda: ledger.save_submitted(f"{p}job-stale", 7, job("job-stale"), 0.0, None),
        lambda: ledger.claim_for_observe(f"{p}claim-ok", pc[f"{p}claim-ok"]),
        lambda: ledger.claim_for_observe(f"{p}claim-stale", pc[f"{p}claim-stale"] - 1),
        lambda: ledger.claim_for_observe(f"{p}claim-unknown", 1),
        lambda: ledger.reschedule_poll(f"{p}resched-ok", pc[f"{p}resched-ok"], 900.0),
        lambda: ledger.reschedule_poll(f"{p}resched-stale", pc[f"{p}resched-stale"] + 1, 900.0),
        lambda: ledger.save_observation(f"{p}save-succ", fence["save-succ"], succeeded(job("save-succ"), p), None),
        lambda: ledger.save_observation(f"{p}save-failed", fence["save-failed"], failed(job("save-failed"), p), None),
        lambda: ledger.save_observation(
            f"{p}save-running", fence["save-running"], JobSnapshot(job("save-running"), "running", S.RUNNING), 900.0
        ),
        lambda: ledger.save_observation(f"{p}save-fence", fence["save-fence"], succeeded(job("save-fence"), p), None),
        lambda: ledger.save_observation(
            f"{p}save-order", fence["save-order"], JobSnapshot(order_job, "running", S.RUNNING), 900.0
        ),
        lambda: ledger.save_observation(f"{p}save-unknown", 1, succeeded(job("save-unknown"), p), None),
        lambda: ledger.record_remote_call(RemoteCall(f"{p}acct", "POST", 201, Outcome.CREATED, job("acct"), 5.5, 1)),
        lambda: ledger.record_remote_call(RemoteCall(f"{p}acct", "GET", 200, Outcome.RUNNING, job("acct"), 2.25, 2)),
        lambda: ledger.record_remote_call(
            RemoteCall(f"{p}acct-unknown", "POST", 201, Outcome.CREATED, job("acct-u"), 5.0, 1)
        ),
    ]


def normal(value: Any, p: str) -> Any:
    """A result or row value with the copy's prefix taken out (claims: the time observed only as "recent")."""
    if isinstance(value, ObserveClaim):
        return (value.fencing_token, value.remote_job_id.replace(p, ""), value.state, value.poll_count,
                0 <= value.observed_for_s < 600)  # fmt: skip
    return str(value).replace(p, "")


TABLES = {
    "operations": """
        SELECT operation_id, state, fencing_token, transition_seq, remote_job_id, poll_claim_id, poll_count,
               unknown_status_count, reason, reason_code, last_observation, remote_completed_at, submitted_at_ms,
               request::text, source::text, updated_by, next_poll_at IS NULL AS not_polled,
               round(extract(epoch FROM next_poll_at - now()) / 100) AS due_in_100s
        FROM operations WHERE operation_id LIKE $1 ORDER BY operation_id""",
    "transitions": """
        SELECT operation_id, seq, from_state, to_state, fencing_token, reason, worker
        FROM transitions WHERE operation_id LIKE $1 ORDER BY operation_id, seq""",
    "outbox": """
        SELECT event_id, topic_role, operation_id, output_id, payload - 'at_ms' - 'recorded_at_ms' AS payload,
               published_at, row_number() OVER (PARTITION BY operation_id ORDER BY id) AS nth
        FROM outbox WHERE operation_id LIKE $1 ORDER BY operation_id, id""",
    "outputs": """
        SELECT operation_id, output_id, position, payload FROM outputs WHERE operation_id LIKE $1
        ORDER BY operation_id, position""",
    "remote_jobs": """
        SELECT remote_job_id, operation_id, learned_via, learned_by, last_status, outcome, outcome_at IS NULL,
               charge, charge_amount, charge_currency
        FROM remote_jobs WHERE operation_id LIKE $1 ORDER BY remote_job_id""",
    "refunds": """
        SELECT r.refund_id, r.remote_job_id, r.refund, r.amount, r.currency
        FROM refunds r JOIN remote_jobs j USING (remote_job_id) WHERE j.operation_id LIKE $1 ORDER BY 1, 2""",
    "remote_calls": """
        SELECT operation_id, method, status_code, outcome, remote_job_id, duration_ms, fencing_token, worker
        FROM remote_calls WHERE operation_id LIKE $1 ORDER BY operation_id, id""",
}


async def rows(pool: asyncpg.Pool, p: str) -> dict[str, list[list[Any]]]:
    """Every row the copy ``p`` has in the ledger's tables, with the prefix taken out."""
    out: dict[str, list[list[Any]]] = {}
    for table, sql in TABLES.items():
        out[table] = [[normal(v, p) for v in r.values()] for r in await pool.fetch(sql, p + "%")]
    return out


async def test_a_batch_gives_each_request_what_its_own_statement_gives_row_by_row(
    pool: asyncpg.Pool, logged: Logged
) -> None:
    single = Ledger(pool, "w", batching=False)
    batched = Ledger(logged.pool, "w")
    single_calls = await scenario(single, "ONE.")
    batch_calls = await scenario(batched, "MANY.")

    one_by_one = [await call() for call in single_calls]
    sent_before = {stage: await logged.sent(stage) for stage in STAGE_QUERIES}
    together = await asyncio.gather(*(call() for call in batch_calls))

    assert [await logged.sent(stage) - sent_before[stage] for stage in STAGE_QUERIES] == [1] * 7  # one per kind
    assert [normal(r, "MANY.") for r in together] == [normal(r, "ONE.") for r in one_by_one]
    assert [normal(r, "ONE.") for r in one_by_one] == [
        "True", "False", "1", "None", "None", "True", "True", "False",
        (2, "claim-ok-job", S.SUBMITTED, 0, True), "None", "None", "True", "False",
        "saved", "saved", "saved", "refused_fencing", "refused_order", "refused_order",
        "None", "None", "None",
    ]  # fmt: skip
    single_rows, batch_rows = await rows(pool, "ONE."), await rows(pool, "MANY.")
    for table in TABLES:
        assert batch_rows[table] == single_rows[table], table
    # what was written, checked once in the clear: the transition events and outbox rows of the saves
    outbox = [(r[0], r[1], r[3]) for r in batch_rows["outbox"] if r[2] in ("save-succ", "save-failed")]
    assert outbox == [
        ("transition:save-failed:1:accepted", "transitions", "None"),
        ("transition:save-failed:2:submitting", "transitions", "None"),
        ("transition:save-failed:3:submitted", "transitions", "None"),
        ("transition:save-failed:4:failed", "transitions", "None"),
        ("transition:save-succ:1:accepted", "transitions", "None"),
        ("transition:save-succ:2:submitting", "transitions", "None"),
        ("transition:save-succ:3:submitted", "transitions", "None"),
        ("output:save-succ:o1", "outputs_delivered", "o1"),
        ("output:save-succ:o2", "outputs_delivered", "o2"),
        ("transition:save-succ:4:succeeded", "transitions", "None"),
    ]
    assert [r[:3] for r in batch_rows["refunds"]] == [["rf", "save-failed-job", str({"id": "rf", "amount": "0.5",
                                                       "currency": "USD"})]]  # fmt: skip
    assert [r[2] for r in batch_rows["remote_jobs"] if r[1] in ("acct", "acct-unknown")] == ["post_2xx"]


async def test_n_concurrent_saves_cost_one_round_trip_instead_of_n(pool: asyncpg.Pool, logged: Logged) -> None:
    setup = Ledger(pool, "w", batching=False)
    ops = [f"op-{i:02d}" for i in range(24)]
    fencing = {op: await observed(setup, op) for op in ops}
    batched = Ledger(logged.pool, "w")
    before = await logged.sent("save_observation")
    outcomes = await asyncio.gather(
        *(batched.save_observation(op, fencing[op], succeeded(f"{op}-job", op), None) for op in ops)
    )
    assert outcomes == [SaveOutcome.SAVED] * len(ops)
    assert await logged.sent("save_observation") - before == 1  # against 24 statements one by one
    assert await pool.fetchval("SELECT count(*) FROM outputs") == 2 * len(ops)
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE topic_role = 'outputs_delivered'") == 2 * len(ops)

    unbatched = Ledger(logged.pool, "w", batching=False)
    ops2 = [f"op2-{i:02d}" for i in range(24)]
    fencing = {op: await observed(setup, op) for op in ops2}
    before = await logged.sent("save_observation")
    await asyncio.gather(
        *(unbatched.save_observation(op, fencing[op], succeeded(f"{op}-job", op), None) for op in ops2)
    )
    assert await logged.sent("save_observation") - before == len(ops2)


async def test_a_value_postgres_refuses_fails_only_its_own_request(pool: asyncpg.Pool, logged: Logged) -> None:
    setup = Ledger(pool, "w", batching=False)
    ops = ["op-a", "op-b", "op-nul", "op-c"]
    fencing = {op: await observed(setup, op) for op in ops}
    nul_output = [{"id": "o1", "text": "a\x00b"}]  # jsonb cannot hold \u0000
    nul = JobSnapshot("op-nul-job", "succeeded", S.SUCCEEDED, outputs=nul_output, completed_at_ms=1)
    snapshots = {op: succeeded(f"{op}-job", op) for op in ops} | {"op-nul": nul}
    batched = Ledger(logged.pool, "w")
    before = await logged.sent("save_observation")
    labels = {"stage": "save_observation", "reason": "refused_value"}
    fallbacks = REGISTRY.get_sample_value("streams_ledger_batch_fallbacks_total", labels) or 0.0
    results = await asyncio.gather(
        *(batched.save_observation(op, fencing[op], snapshots[op], None) for op in ops), return_exceptions=True
    )
    assert results[:2] == [SaveOutcome.SAVED] * 2 and results[3] == SaveOutcome.SAVED
    assert isinstance(results[2], LedgerDataError) and "op-nul" in str(results[2])
    assert await logged.sent("save_observation") - before == 1 + len(ops)  # the batch, then one by one
    assert REGISTRY.get_sample_value("streams_ledger_batch_fallbacks_total", labels) == fallbacks + 1
    states = dict(await pool.fetch("SELECT operation_id, state::text FROM operations"))
    assert states == {"op-a": "succeeded", "op-b": "succeeded", "op-nul": "submitted", "op-c": "succeeded"}
    assert await pool.fetchval("SELECT count(*) FROM outputs WHERE operation_id = 'op-nul'") == 0
    # the observer then records the answer as failed ("unstorable_response"): that save goes through alone
    unstorable = JobSnapshot("op-nul-job", "failed", S.FAILED, error={"code": "unstorable_response", "message": "x"})
    assert await batched.save_observation("op-nul", fencing["op-nul"], unstorable, None) is SaveOutcome.SAVED


async def test_a_value_postgres_cannot_index_fails_only_its_own_request(pool: asyncpg.Pool, logged: Logged) -> None:
    """An output id too long for a btree index row (PostgreSQL refuses it with SQLSTATE 54000, "program limit
    exceeded", not a class 22 or 23 error) beside good saves in one batch: only its own caller gets a
    LedgerDataError (which the observer records as an unstorable answer); the others are saved."""
    setup = Ledger(pool, "w", batching=False)
    ops = ["op-a", "op-huge", "op-b"]
    fencing = {op: await observed(setup, op) for op in ops}
    huge_id = secrets.token_urlsafe(6000)  # random text: pglz cannot compress it under the ~2.7 kB limit
    huge = JobSnapshot("op-huge-job", "succeeded", S.SUCCEEDED, outputs=[{"id": huge_id}], completed_at_ms=1)
    snapshots = {op: succeeded(f"{op}-job", op) for op in ops} | {"op-huge": huge}
    batched = Ledger(logged.pool, "w")
    results = await asyncio.gather(
        *(batched.save_observation(op, fencing[op], snapshots[op], None) for op in ops), return_exceptions=True
    )
    assert results[0] == SaveOutcome.SAVED and results[2] == SaveOutcome.SAVED, results
    assert isinstance(results[1], LedgerDataError) and "op-huge" in str(results[1]), results[1]
    assert "ProgramLimitExceededError" in str(results[1])
    states = dict(await pool.fetch("SELECT operation_id, state::text FROM operations"))
    assert states == {"op-a": "succeeded", "op-huge": "submitted", "op-b": "succeeded"}
    # alone (without batching) the same: a LedgerDataError the observer handles, never a raw asyncpg error
    with pytest.raises(LedgerDataError):
        await Ledger(pool, "w", batching=False).save_observation("op-huge", fencing["op-huge"], huge, None)


async def test_two_requests_for_one_operation_in_a_batch_act_as_if_made_one_after_the_other(
    pool: asyncpg.Pool, logged: Logged
) -> None:
    """Two tasks handling one operation (a poll event read twice): their claims and saves may share a batch; each
    sees the poll claim, the fencing value and the state order as if its statement ran after the other's."""
    setup = Ledger(pool, "w", batching=False)
    await submitted(setup, "op-twice")
    poll_claim_id = (await polled(setup, ["op-twice"]))["op-twice"]
    batched = Ledger(logged.pool, "w")
    before = await logged.sent("claim_observe")
    first, second = await asyncio.gather(
        batched.claim_for_observe("op-twice", poll_claim_id), batched.claim_for_observe("op-twice", poll_claim_id)
    )
    assert first is not None and second is None  # the poll claim is observed once: the second finds it taken
    assert first.fencing_token == 2
    assert await logged.sent("claim_observe") - before == 2
    job = "op-twice-job"
    fencing = first.fencing_token
    outcomes = await asyncio.gather(
        batched.save_observation("op-twice", fencing - 1, succeeded(job, "x"), None),  # the submit claim's value
        batched.save_observation("op-twice", fencing, JobSnapshot(job, "running", S.RUNNING), 9.0),
        batched.save_observation("op-twice", fencing, succeeded(job, "x"), None),
        batched.save_observation("op-twice", fencing, succeeded(job, "x"), None),
    )
    assert list(outcomes) == [  # gather's list, typed as a tuple
        SaveOutcome.REFUSED_FENCING,
        SaveOutcome.SAVED,
        SaveOutcome.SAVED,
        SaveOutcome.REFUSED_ORDER,  # a repeat of succeeded writes nothing
    ]
    transitions = await pool.fetch("SELECT seq, to_state::text FROM transitions WHERE operation_id = 'op-twice'")
    assert [tuple(t) for t in transitions] == [
        (1, "accepted"), (2, "submitting"), (3, "submitted"), (4, "running"), (5, "succeeded")
    ]  # fmt: skip
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE operation_id = 'op-twice'") == 7


async def lock_waiters(pool: asyncpg.Pool) -> int:
    """Backends of the test database waiting for a lock."""
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    )


async def wait_for_lock_waiters(pool: asyncpg.Pool, n: int) -> None:
    for _ in range(400):
        if await lock_waiters(pool) >= n:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{n} statements never waited for a lock")


@pytest.mark.parametrize("stage", ["claim_observe", "save_observation"])
async def test_two_batches_locking_the_same_operations_in_opposite_orders_do_not_deadlock(
    pool: asyncpg.Pool, migrated: Settings, stage: str
) -> None:
    """Both statements sent as given (not through the ledger, which sorts them too), while a third transaction
    holds both rows; once it commits, both go through: rows are locked in operation id order."""
    setup = Ledger(pool, "w", batching=False)
    ops = ["op-a", "op-b"]
    if stage == "claim_observe":  # polls claimed by the scheduler, not yet taken by an observer
        for op in ops:
            await submitted(setup, op)
        assert set((await polled(setup, ops)).values()) == {1}
        fencing = {op: 1 for op in ops}
    else:
        fencing = {op: await observed(setup, op) for op in ops}
    poll_claim_id = 1
    running = '{"status": "running"}'

    def arrays(order: list[str]) -> dict[str, Any]:
        common = {"operation_ids": order, "worker": "w", "lock_timeout": "0"}
        if stage == "claim_observe":
            return {**common, "poll_claim_ids": [poll_claim_id] * 2, "claim_ids": [uuid.uuid4(), uuid.uuid4()]}
        n = len(order)
        return {
            **common,
            "fencing_tokens": [fencing[o] for o in order],
            "states": ["running"] * n,
            "observations": [running] * n,
            "next_poll_delays_s": [9.0] * n,
            "remote_completed_at_ms": [None] * n,
            "reasons": [None] * n,
            "source_states": ["{submitted,queued,running}"] * n,
            "outputs": ["[]"] * n,
            **no_calls(n, job=True),
        }

    url = migrated.database_url.get_secret_value()
    holder, first, second = [await asyncpg.connect(url) for _ in range(3)]
    for conn in (first, second):
        await _init_connection(conn)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT 1 FROM operations WHERE operation_id = ANY($1) FOR UPDATE", ops)
        query = Q.claim_for_observe if stage == "claim_observe" else Q.save_observation
        one = asyncio.ensure_future(query.fetch(first, **arrays(["op-a", "op-b"])))
        two = asyncio.ensure_future(query.fetch(second, **arrays(["op-b", "op-a"])))
        await wait_for_lock_waiters(pool, 2)
        await tx.commit()
        results = await asyncio.wait_for(asyncio.gather(one, two), timeout=30)  # a deadlock would raise here
    finally:
        for conn in (holder, first, second):
            await conn.close()
    tokens = dict(await pool.fetch("SELECT operation_id, fencing_token FROM operations"))
    if stage == "claim_observe":  # one statement took both claims, the other found them taken
        assert sorted(len(r) for r in results) == [0, 2]
        assert tokens == {op: fencing[op] + 1 for op in ops}
    else:
        assert [len(r) for r in results] == [2, 2]
        assert tokens == fencing


async def test_a_batch_chosen_as_deadlock_victim_runs_again_and_its_callers_get_their_results(
    pool: asyncpg.Pool, migrated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deadlock with a statement of another kind (here a transaction locking the rows in the other order):
    PostgreSQL rolls the batch back, the ledger runs it again, no caller sees an error. (A batch's lock timeout
    is shorter than PostgreSQL's deadlock_timeout, so a batch gives up waiting before any deadlock is detected;
    it is lifted here so that the deadlock happens.)"""
    monkeypatch.setattr(ledger_module, "BATCH_LOCK_TIMEOUT", WAIT_FOR_LOCKS)
    setup = Ledger(pool, "w", batching=False)
    await submitted(setup, "op-a")
    await submitted(setup, "op-b")
    pc = await polled(setup, ["op-a", "op-b"])
    labels = {"stage": "claim_observe", "sqlstate": "40P01"}
    conflicts = REGISTRY.get_sample_value("streams_ledger_conflicts_total", labels) or 0.0
    batched = Ledger(pool, "w")
    holder = await asyncpg.connect(migrated.database_url.get_secret_value())
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SET LOCAL deadlock_timeout = '20s'")  # the batch's check runs first: it is the victim
        await holder.execute("SELECT 1 FROM operations WHERE operation_id = 'op-b' FOR UPDATE")
        claims = asyncio.ensure_future(
            asyncio.gather(*(batched.claim_for_observe(op, pc[op]) for op in ("op-b", "op-a")))
        )
        await wait_for_lock_waiters(pool, 1)  # the batch holds op-a and waits for op-b
        await holder.execute("SELECT 1 FROM operations WHERE operation_id = 'op-a' FOR UPDATE")  # the cycle
        await tx.commit()
        b, a = await asyncio.wait_for(claims, timeout=30)
    finally:
        await holder.close()
    assert a is not None and b is not None and (a.fencing_token, b.fencing_token) == (2, 2)
    assert REGISTRY.get_sample_value("streams_ledger_conflicts_total", labels) == conflicts + 1


async def test_a_row_held_by_another_transaction_holds_up_only_its_own_request(
    pool: asyncpg.Pool, logged: Logged, migrated: Settings
) -> None:
    """A batch meeting a lock held elsewhere gives up after its lock timeout; the other requests are written at
    once, the held one waits alone, and later batches of the kind go through meanwhile. The same for an
    operation id whose INSERT by another transaction is not committed yet."""
    setup = Ledger(pool, "w", batching=False)
    await submitted(setup, "op-a")
    await submitted(setup, "op-held")
    await submitted(setup, "op-b")
    await submitted(setup, "op-later")
    pc = await polled(setup, ["op-a", "op-held", "op-b", "op-later"])
    batched = Ledger(logged.pool, "w")
    holder = await asyncpg.connect(migrated.database_url.get_secret_value())
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT 1 FROM operations WHERE operation_id = 'op-held' FOR UPDATE")
        await holder.execute(
            "INSERT INTO operations (operation_id, request, updated_by) VALUES ('op-new-held', '{}', 'holder')"
        )
        held = asyncio.ensure_future(batched.claim_for_observe("op-held", pc["op-held"]))
        new_held = asyncio.ensure_future(batched.accept("op-new-held", REQUEST, submitted_at_ms=1))
        others = asyncio.gather(*(batched.claim_for_observe(op, pc[op]) for op in ("op-a", "op-b")))
        a, b = await asyncio.wait_for(others, timeout=20)  # not held up by op-held
        assert a is not None and b is not None
        assert await asyncio.wait_for(batched.accept("op-new", REQUEST, submitted_at_ms=1), timeout=20)
        assert await asyncio.wait_for(batched.claim_for_observe("op-later", pc["op-later"]), timeout=20) is not None
        assert not held.done() and not new_held.done()
        await tx.rollback()
        claim = await asyncio.wait_for(held, timeout=30)
        assert claim is not None and claim.fencing_token == 2
        assert await asyncio.wait_for(new_held, timeout=30) is True  # the other INSERT was rolled back
    finally:
        await holder.close()


@contextlib.asynccontextmanager
async def reply_cutting_ledger(settings: Settings) -> AsyncIterator[tuple[Ledger, ReplyCutter]]:
    """A batching ledger whose connections go through a :class:`ReplyCutter` to PostgreSQL: arm the cutter's
    ``marker`` to lose the reply of the next statement carrying it, after PostgreSQL ran it."""
    url = urlsplit(settings.database_url.get_secret_value())
    relay = ReplyCutter(url.port or 5432)
    await relay.start()
    relayed = await asyncpg.create_pool(
        urlunsplit(url._replace(netloc=f"{url.username}:{url.password}@127.0.0.1:{relay.port}")),
        min_size=1,
        max_size=2,
        init=_init_connection,
    )
    try:
        yield Ledger(relayed, "w"), relay
    finally:
        await relayed.close()
        await relay.stop()


async def test_a_claim_or_save_whose_reply_was_lost_after_it_committed_is_still_its_callers(
    pool: asyncpg.Pool, migrated: Settings
) -> None:
    """The connection drops after PostgreSQL committed a batch of claims and before their replies were read: every
    caller gets LedgerUnavailableError and sends its claim again (``ledger.waiting``). The repeat must give
    the caller its claim (the fencing value written), not "already dispatched"; the same for the job ids' save
    ("saved", not "refused by fencing") and for an accounting row (written once)."""
    setup = Ledger(pool, "w", batching=False)
    ops = ["op-cut-1", "op-cut-2"]
    for op in ops:
        assert await setup.accept(op, REQUEST, submitted_at_ms=1)
    async with reply_cutting_ledger(migrated) as (batched, relay):
        relay.marker = b"op-cut-1"
        claim_ids = {op: uuid.uuid4() for op in ops}
        first = await asyncio.gather(
            *(batched.claim_for_submit(op, claim_ids[op]) for op in ops), return_exceptions=True
        )
        assert relay.cut == 1
        assert all(isinstance(r, LedgerUnavailableError) for r in first), first
        states = dict(await pool.fetch("SELECT operation_id, state::text FROM operations"))
        assert states == dict.fromkeys(ops, "submitting")  # committed before the cut
        again = await asyncio.gather(*(batched.claim_for_submit(op, claim_ids[op]) for op in ops))
        assert again == [1, 1], "each caller's own claim, as written"
        assert await batched.claim_for_submit(ops[0]) is None  # another claim still finds it taken
        assert await batched.claim_for_submit(ops[0], claim_ids[ops[1]]) is None  # and so does another's id
        tokens = dict(await pool.fetch("SELECT operation_id, fencing_token FROM operations"))
        assert tokens == dict.fromkeys(ops, 1)  # the repeat wrote nothing
        # the job ids' save: its reply lost after the commit, the repeat is told "saved", not "refused"
        relay.marker = b"job-cut-1"
        saves = [batched.save_submitted(op, 1, f"job-cut-{n}", 60.0, None) for n, op in enumerate(ops, 1)]
        first_saves = await asyncio.gather(*saves, return_exceptions=True)
        assert relay.cut == 2
        assert all(isinstance(r, LedgerUnavailableError) for r in first_saves), first_saves
        again_saves = [batched.save_submitted(op, 1, f"job-cut-{n}", 60.0, None) for n, op in enumerate(ops, 1)]
        assert await asyncio.gather(*again_saves) == [True, True]
        assert await batched.save_submitted(ops[0], 1, "job-other", 60.0, None) is False  # another job id: refused
        assert await batched.save_submitted(ops[0], 0, "job-other", 60.0, None) is False  # a stale claim: refused
        jobs = dict(await pool.fetch("SELECT operation_id, remote_job_id FROM operations"))
        assert jobs == {"op-cut-1": "job-cut-1", "op-cut-2": "job-cut-2"}
        # an accounting row: its reply lost after the commit, the repeat writes no second row
        relay.marker = b"job-acct-1"
        calls = [(op, uuid.uuid4(), f"job-acct-{n}") for n, op in enumerate(ops, 1)]

        def record() -> Any:
            return asyncio.gather(
                *(
                    batched.record_remote_call(RemoteCall(op, "POST", 201, Outcome.CREATED, job, 12.5, 1, call_id))
                    for op, call_id, job in calls
                ),
                return_exceptions=True,
            )

        first_records = await record()
        assert relay.cut == 3, (first_records, relay.marker)
        assert all(isinstance(r, LedgerUnavailableError) for r in first_records), first_records
        assert await record() == [None, None]
        rows = await pool.fetch("SELECT operation_id, remote_job_id FROM remote_calls ORDER BY operation_id")
        assert [tuple(r) for r in rows] == [("op-cut-1", "job-acct-1"), ("op-cut-2", "job-acct-2")]


async def test_a_save_sent_again_after_its_first_poll_was_taken_is_still_saved(
    pool: asyncpg.Pool, migrated: Settings
) -> None:
    """A job id's save whose reply was lost stays "saved" when it is sent again after the operation moved on: a
    ``ledger.waiting`` repeat can come after PostgreSQL's outage outlasted the first poll's delay, and taking
    that poll raised the fencing value. The job id on the row is the one this save wrote (a job id belongs to the
    one POST that created it), so "refused by fencing" would be a false alarm."""
    ledger = Ledger(pool, "w", batching=False)
    await submitted(ledger, "op-moved-on")  # claimed with fencing 1, job op-moved-on-job saved
    assert await observed_again_fencing(ledger, "op-moved-on") == 2  # its first poll taken
    assert await ledger.save_submitted("op-moved-on", 1, "op-moved-on-job", 0.0, None) is True
    assert await ledger.save_submitted("op-moved-on", 1, "another-job", 0.0, None) is False
    row = await pool.fetchrow("SELECT state::text, fencing_token FROM operations WHERE operation_id = 'op-moved-on'")
    assert tuple(row) == ("submitted", 2)  # the repeat wrote nothing


async def test_an_end_without_a_job_sent_again_after_its_reply_was_lost_is_still_saved(
    pool: asyncpg.Pool, migrated: Settings
) -> None:
    """``submitting -> rejected|uncertain`` committed, its reply lost, sent again by ``ledger.waiting``: the
    repeat is told "saved" (the row holds its state, reason and code at its fencing value), not "refused by fencing";
    another end, or a stale claim's, is still refused and changes nothing."""
    ledger = Ledger(pool, "w", batching=False)
    assert await ledger.accept("op-ended", REQUEST, submitted_at_ms=1)
    fencing = await ledger.claim_for_submit("op-ended")
    assert fencing == 1
    end = ("op-ended", fencing, S.REJECTED, "HTTP 400: bad prompt", ReasonCode.REFUSED)
    assert await ledger.save_submission_without_job(*end) is True
    assert await ledger.save_submission_without_job(*end) is True  # the same end again: its reply was lost
    assert (
        await ledger.save_submission_without_job("op-ended", 1, S.UNCERTAIN, "timeout", ReasonCode.UNKNOWN_OUTCOME)
        is False
    )
    assert (
        await ledger.save_submission_without_job("op-ended", 0, S.REJECTED, "HTTP 400: bad prompt", ReasonCode.REFUSED)
        is False
    )
    rows = await pool.fetch("SELECT to_state::text FROM transitions WHERE operation_id = 'op-ended' ORDER BY id")
    assert [r["to_state"] for r in rows] == ["accepted", "submitting", "rejected"]  # the repeat wrote nothing
    row = await pool.fetchrow(
        "SELECT state::text, reason, fencing_token FROM operations WHERE operation_id = 'op-ended'"
    )
    assert tuple(row) == ("rejected", "HTTP 400: bad prompt", 1)


async def observed_again_fencing(ledger: Ledger, op: str) -> int:
    """Take the due poll of the submitted ``op`` for observing; the fencing value it raised to."""
    claim = await ledger.claim_for_observe(op, (await polled(ledger, [op]))[op])
    assert claim is not None
    return claim.fencing_token


async def test_an_observer_claim_whose_reply_was_lost_after_it_committed_is_still_its_callers(
    pool: asyncpg.Pool, migrated: Settings
) -> None:
    """The same for the observer's claim of a poll: the repeat gets the claim (fencing value, job id) the first one
    wrote, not "poll already taken" (which would leave the job unpolled for a visibility timeout); another claim
    of the same poll still finds it taken."""
    setup = Ledger(pool, "w", batching=False)
    ops = ["op-obs-1", "op-obs-2"]
    for op in ops:
        await submitted(setup, op)
    pc = await polled(setup, ops)
    async with reply_cutting_ledger(migrated) as (batched, relay):
        claim_ids = {op: uuid.uuid4() for op in ops}
        relay.marker = b"op-obs-1"
        first = await asyncio.gather(
            *(batched.claim_for_observe(op, pc[op], claim_ids[op]) for op in ops), return_exceptions=True
        )
        assert relay.cut == 1
        assert all(isinstance(r, LedgerUnavailableError) for r in first), first
        again = await asyncio.gather(*(batched.claim_for_observe(op, pc[op], claim_ids[op]) for op in ops))
        assert [(c.fencing_token, c.remote_job_id) if c else None for c in again] == [
            (2, "op-obs-1-job"),
            (2, "op-obs-2-job"),
        ]
        assert await batched.claim_for_observe(ops[0], pc[ops[0]]) is None  # another claim: the poll is taken
        tokens = dict(await pool.fetch("SELECT operation_id, fencing_token FROM operations"))
        assert tokens == dict.fromkeys(ops, 2)  # the repeat wrote nothing


async def test_a_batch_cancelled_by_postgresql_is_unavailable_to_its_callers_not_a_raw_error(
    pool: asyncpg.Pool, logged: Logged, migrated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's ``pg_cancel_backend`` (or a ``statement_timeout``) cancels a batched statement: nothing was
    written and running it again is safe, so every caller of the batch gets LedgerUnavailableError, which it waits
    out (``ledger.waiting``), never asyncpg's QueryCanceledError (raised at once, the event's handling
    dropped) for every operation that shared the statement."""
    monkeypatch.setattr(ledger_module, "BATCH_LOCK_TIMEOUT", WAIT_FOR_LOCKS)  # the batch waits: time to cancel it
    setup = Ledger(pool, "w", batching=False)
    ops = ["op-a", "op-b", "op-held"]
    for op in ops:
        await submitted(setup, op)
    pc = await polled(setup, ops)
    batched = Ledger(logged.pool, "w")
    holder = await asyncpg.connect(migrated.database_url.get_secret_value())
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT 1 FROM operations WHERE operation_id = 'op-held' FOR UPDATE")
        claims = asyncio.ensure_future(
            asyncio.gather(*(batched.claim_for_observe(op, pc[op]) for op in ops), return_exceptions=True)
        )
        await wait_for_lock_waiters(pool, 1)
        cancelled = await pool.fetchval(
            "SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        assert cancelled == 1
        results = await asyncio.wait_for(claims, timeout=30)
        await tx.rollback()
    finally:
        await holder.close()
    assert [type(r) for r in results] == [LedgerUnavailableError] * 3, results
    tokens = dict(await pool.fetch("SELECT operation_id, fencing_token FROM operations"))
    assert tokens == dict.fromkeys(ops, 1)  # nothing written


async def test_a_caller_cancelled_while_it_runs_alone_after_a_lock_wait_leaves_nothing_behind(
    pool: asyncpg.Pool, logged: Logged, migrated: Settings
) -> None:
    """A batch gave up on a held row and its caller runs the request alone, waiting for the lock; the caller is
    cancelled (a rebalance): its statement is cancelled too (no backend left waiting), nothing is written once the
    row is free, and the pool serves the next batches."""
    setup = Ledger(pool, "w", batching=False)
    await submitted(setup, "op-held")
    await submitted(setup, "op-next")
    pc = await polled(setup, ["op-held", "op-next"])
    batched = Ledger(logged.pool, "w")
    holder = await asyncpg.connect(migrated.database_url.get_secret_value())
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT 1 FROM operations WHERE operation_id = 'op-held' FOR UPDATE")
        labels = {"stage": "claim_observe", "reason": "lock_wait"}
        fallbacks = REGISTRY.get_sample_value("streams_ledger_batch_fallbacks_total", labels) or 0.0
        alone = asyncio.ensure_future(batched.claim_for_observe("op-held", pc["op-held"]))

        async def waiting_alone() -> bool:  # the batch gave up after its lock timeout; the request waits alone
            gave_up = REGISTRY.get_sample_value("streams_ledger_batch_fallbacks_total", labels) == fallbacks + 1
            return gave_up and await lock_waiters(pool) == 1

        await wait_for(waiting_alone, 10, "the request waiting alone for the held row")
        assert not alone.done()
        alone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await alone
        for _ in range(200):
            if await lock_waiters(pool) == 0:
                break
            await asyncio.sleep(0.025)
        assert await lock_waiters(pool) == 0
        await tx.commit()
    finally:
        await holder.close()
    claim = await asyncio.wait_for(batched.claim_for_observe("op-next", pc["op-next"]), timeout=10)
    assert claim is not None and claim.fencing_token == 2
    tokens = dict(await pool.fetch("SELECT operation_id, fencing_token FROM operations"))
    assert tokens == {"op-held": 1, "op-next": 2}  # the cancelled claim wrote nothing


async def _secondary_index_reads(conn: asyncpg.Connection) -> dict[str, int]:
    """Index entries of ``operations`` read by this transaction so far, per index other than the primary key."""
    rows = await conn.fetch(
        "SELECT i.indexrelid::regclass::text AS name, pg_stat_get_xact_tuples_returned(i.indexrelid) AS n"
        " FROM pg_index i WHERE i.indrelid = 'operations'::regclass AND i.indexrelid <> 'operations_pkey'::regclass"
    )
    return {r["name"]: r["n"] for r in rows if r["n"]}


async def test_batched_claims_and_saves_find_their_rows_by_primary_key_with_a_plan_made_on_an_empty_table(
    pool: asyncpg.Pool,
) -> None:
    """A worker prepares its statements when the ledger is new (empty), and each connection keeps the plan it made
    then. The claims and the job-id save must still find their batch's rows by primary key, not by reading every
    accepted, job-less or pollable operation through a state or partial index (they did: the cached plans, made
    when those indexes looked empty, scanned them in full for every batch)."""
    n = 300
    accepted, submitting, submitted = ([f"op-{k}-{i:04d}" for i in range(n)] for k in "abc")
    fixed = {"worker": "w", "lock_timeout": "0"}
    async with pool.acquire() as conn:
        await conn.execute("SET plan_cache_mode = force_generic_plan")  # the plan made at the first run is kept
        warm: dict[str, dict[str, object]] = {  # first run of each on the empty table: its plan is made now
            "claim_for_submit": {"operation_ids": [], "claim_ids": [], **fixed},
            "save_submitted": {
                "operation_ids": [],
                "fencing_tokens": [],
                "remote_job_ids": [],
                "first_poll_delays_s": [],
                "first_poll_claim_ids": [],
                "reasons": [],
                **no_calls(0, job=False),
                **fixed,
            },
            "claim_for_observe": {"operation_ids": [], "poll_claim_ids": [], "claim_ids": [], **fixed},
            "reschedule_poll": {"operation_ids": [], "poll_claim_ids": [], "delays_s": [], "lock_timeout": "0"},
        }
        for name, values in warm.items():
            assert await getattr(Q, name).fetch(conn, **values) == []

        everyone = accepted + submitting + submitted
        await Q.accept_operation.fetch(
            pool,
            operation_ids=everyone,
            requests=[REQUEST] * 3 * n,
            submitted_at_ms=[1] * 3 * n,
            sources=[None] * 3 * n,
            **fixed,
        )
        await Q.claim_for_submit.fetch(
            pool, operation_ids=submitting + submitted, claim_ids=[uuid.uuid4() for _ in range(2 * n)], **fixed
        )
        await Q.save_submitted.fetch(
            pool,
            operation_ids=submitted,
            fencing_tokens=[1] * n,
            remote_job_ids=[f"job-{o}" for o in submitted],
            first_poll_delays_s=[60.0] * n,
            first_poll_claim_ids=[None] * n,
            reasons=[None] * n,
            **no_calls(n, job=False),
            **fixed,
        )
        # the scheduler's claim of two polls (claim id 0 kept): claim_for_observe takes only a claimed poll
        await pool.execute("UPDATE operations SET poll_claimed_at = now() WHERE operation_id = ANY($1)", submitted[:2])

        runs: dict[str, dict[str, object]] = {
            "claim_for_submit": {"operation_ids": accepted[:2], "claim_ids": [uuid.uuid4(), uuid.uuid4()], **fixed},
            "save_submitted": {
                "operation_ids": submitting[:2],
                "fencing_tokens": [1, 1],
                "remote_job_ids": ["job-x", "job-y"],
                "first_poll_delays_s": [1.0, 1.0],
                "first_poll_claim_ids": [uuid.uuid4(), None],  # one save claims its first poll, one does not
                "reasons": [None, None],
                **no_calls(2, job=False),
                **fixed,
            },
            "claim_for_observe": {
                "operation_ids": submitted[:2],
                "poll_claim_ids": [0, 0],
                "claim_ids": [uuid.uuid4(), uuid.uuid4()],
                **fixed,
            },
            "reschedule_poll": {
                "operation_ids": submitted[2:4],
                "poll_claim_ids": [0, 0],
                "delays_s": [1.0, 1.0],
                "lock_timeout": "0",
            },
        }
        for name, values in runs.items():
            async with conn.transaction():
                rows = await getattr(Q, name).fetch(conn, **values)
                assert sorted(r["i"] for r in rows) == [1, 2], name  # both requests served
                assert await _secondary_index_reads(conn) == {}, name


async def test_closing_the_ledger_while_a_connection_is_held_ends_within_its_bound(
    migrated: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """asyncpg's ``Pool.close`` waits without limit for every connection a task still holds (a worker stopping
    then never ends): ``Ledger.close`` terminates the pool after ``CLOSE_TIMEOUT_S`` and says so."""
    monkeypatch.setattr(store_module, "CLOSE_TIMEOUT_S", 0.5)
    pool = await create_pool(migrated.database_url.get_secret_value(), min_size=1, max_size=2)
    ledger = Ledger(pool, "closing-test")
    held = await pool.acquire()  # never released: a task stuck on it
    await held.execute("SELECT 1")
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(ledger.close(), timeout=10.0)  # the old close waits here for good
    assert asyncio.get_running_loop().time() - started < 5.0
    with pytest.raises(asyncpg.InterfaceError):  # terminated under the task that held it
        await held.execute("SELECT 1")
    assert "were not all back 0.5 s after its pool began to close" in caplog.text
