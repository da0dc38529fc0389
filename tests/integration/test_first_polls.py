"""First polls taken by the worker that saved the job id (streams/worker/stages/firstpoll.py), on real PostgreSQL,
Redis and the simulator: the save claims the poll and this worker observes it with no poll scheduler running;
with the setting at 0 the scheduler's way is kept; a stopping worker makes its waiting first polls due again."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from streams import metrics
from streams.config import Settings
from streams.ledger.records import FirstPollClaim
from streams.ledger.store import Ledger
from streams.worker.runtime import Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.firstpoll import FirstPolls
from streams.worker.stages.observer import Observer
from tests.integration.test_dispatcher import submission
from tests.support import wait_for

pytestmark = pytest.mark.integration


def first_polls(outcome: str) -> float:
    return float(metrics.FIRST_POLLS.labels(outcome)._value.get())


async def row(pool: asyncpg.Pool, op: str) -> asyncpg.Record:
    found = await pool.fetchrow(
        "SELECT state::text AS state, fencing_token, poll_count, poll_claim_id, poll_claimed_at, poll_taken_at,"
        " extract(epoch FROM next_poll_at - now())::float8 AS due_in_s FROM operations WHERE operation_id = $1",
        op,
    )
    assert found is not None
    return found


async def get_fencing_tokens(pool: asyncpg.Pool, op: str) -> list[int]:
    rows = await pool.fetch(
        "SELECT fencing_token FROM remote_calls WHERE operation_id = $1 AND method = 'GET' ORDER BY id", op
    )
    return [r["fencing_token"] for r in rows]


async def test_a_short_hint_first_poll_is_observed_by_the_saving_worker_without_the_scheduler(
    runtime: Runtime, pool: asyncpg.Pool
) -> None:
    op = f"op-fp-{uuid.uuid4().hex[:8]}"
    polls = FirstPolls(runtime, Observer(runtime), asyncio.Semaphore(4))
    observed = first_polls("taken")
    try:
        await Dispatcher(runtime, polls).handle(submission(op))
        saved = await row(pool, op)
        # the save claimed the poll: an observer's fencing value (the submit claim's was 1), a new poll claim, and
        # due for the scheduler only after the visibility timeout
        assert (saved["fencing_token"], saved["poll_claim_id"], saved["poll_claimed_at"]) == (2, 1, None)
        assert saved["poll_taken_at"] is None  # not counted as a poll the observers took (the scheduler's pace)
        assert saved["due_in_s"] > runtime.settings.visibility_timeout_s - 5

        async def polled() -> bool:
            return bool((await row(pool, op))["poll_count"] == 1)

        await wait_for(polled, 10.0, "the first poll observed with no poll scheduler running")
        assert await get_fencing_tokens(pool, op) == [2]  # one GET, under the save's claim

        async def counted() -> bool:  # counted once the observation returns, after its save committed
            return first_polls("taken") == observed + 1

        await wait_for(counted, 10.0, "the first poll counted as taken")
    finally:
        await polls.close()


async def test_with_the_setting_at_zero_the_first_poll_is_the_schedulers(
    settings: Settings, kafka_send: Callable[[str, bytes, bytes], Awaitable[Any]], pool: asyncpg.Pool
) -> None:
    rt = await Runtime.create(
        settings.model_copy(update={"first_poll_in_process_max_s": 0.0}), kafka_send, worker="fp-off"
    )
    op = f"op-fp-off-{uuid.uuid4().hex[:8]}"
    polls = FirstPolls(rt, Observer(rt), asyncio.Semaphore(4))
    try:
        await Dispatcher(rt, polls).handle(submission(op))
        saved = await row(pool, op)
    finally:
        await polls.close()
        await rt.close()
    assert (saved["state"], saved["fencing_token"], saved["poll_claim_id"], saved["poll_taken_at"]) == (
        "submitted",
        1,
        0,
        None,
    )
    assert saved["due_in_s"] < 5.0  # due at its hint, for the scheduler


async def test_a_stopping_worker_makes_its_waiting_first_polls_due_at_once(
    runtime: Runtime, pool: asyncpg.Pool
) -> None:
    op = f"op-fp-stop-{uuid.uuid4().hex[:8]}"
    polls = FirstPolls(runtime, Observer(runtime), asyncio.Semaphore(4))
    given_back = first_polls("given_back")
    await Dispatcher(runtime, polls).handle(submission(op))
    # the poll's task has not run yet (nothing awaited since it was started): it is still waiting for its hint
    await polls.close()
    stopped = await row(pool, op)
    assert (stopped["poll_count"], stopped["poll_claimed_at"]) == (0, None)
    assert stopped["due_in_s"] <= 0.0  # due now, for any worker's scheduler
    assert first_polls("given_back") == given_back + 1
    assert not polls.reserve(0.0)  # closed: no first poll is taken here any more


async def test_one_batch_of_saves_answers_each_request_as_its_own_statement_would(pool: asyncpg.Pool) -> None:
    """Saves made at once go out as one batched statement: the one with a first poll claim id gets its claim, the
    one without is saved with its poll left to the scheduler, the stale one is refused."""
    ledger = Ledger(pool, "batched")
    ops = ["op-b-claim", "op-b-plain", "op-b-stale"]
    fencing: dict[str, int] = {}
    for op in ops:
        assert await ledger.accept(op, '{"input": {"prompt": "p"}}', submitted_at_ms=0)
        claimed = await ledger.claim_for_submit(op)
        assert claimed == 1
        fencing[op] = claimed
    answers = await asyncio.gather(
        ledger.save_submitted(
            "op-b-claim", fencing["op-b-claim"], "job-b-claim", 60.0, None, first_poll_claim_id=uuid.uuid4()
        ),
        ledger.save_submitted("op-b-plain", fencing["op-b-plain"], "job-b-plain", 0.05, None),
        ledger.save_submitted(
            "op-b-stale", fencing["op-b-stale"] + 1, "job-b-stale", 0.05, None, first_poll_claim_id=uuid.uuid4()
        ),
    )
    assert list(answers[1:]) == [True, False]
    assert isinstance(answers[0], FirstPollClaim)
    assert (answers[0].poll_claim_id, answers[0].claim.fencing_token, answers[0].claim.remote_job_id) == (
        1,
        2,
        "job-b-claim",
    )
    states = {op: (await row(pool, op))["state"] for op in ops}
    assert states == {"op-b-claim": "submitted", "op-b-plain": "submitted", "op-b-stale": "submitting"}
