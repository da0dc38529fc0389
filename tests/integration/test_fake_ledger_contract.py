"""The unit tier's in-memory ledger (:mod:`tests.fakes`) against the real one: the same scenario through the real
dispatcher, scheduler, observer, reconciler and relay on both, and every state, transition, outbox event and
accounting row compared. A rule changed in the SQL and not in the fake (or the other way round) fails here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from streams.config import Settings
from streams.ledger.records import CancelPath, FirstPollClaim, ObserveClaim
from streams.ledger.store import Ledger
from streams.model.answers import JobSnapshot
from streams.model.codes import ReasonCode
from streams.model.states import POLLABLE, OperationState
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from streams.worker.stages.reconciler import Reconciler
from streams.worker.stages.relay import OutboxRelay
from streams.worker.stages.scheduler import PollScheduler
from tests.fakes import InMemoryLedger, Sent, fake_leases, mock_remote, observed_again

pytestmark = pytest.mark.integration

REQUEST = '{"input": {"prompt": "hello", "max_tokens": 4}}'


def created(job_id: str) -> httpx.Response:
    return httpx.Response(201, json={"id": job_id, "status": "queued", "poll_after_ms": 0})


def job(job_id: str, status: str | None, outputs: int = 0) -> httpx.Response:
    body: dict[str, Any] = {"id": job_id, "status": status, "poll_after_ms": 0}
    if status == "succeeded":
        body["outputs"] = [{"id": f"out_{i}", "index": i, "text": f"t{i}"} for i in range(outputs)]
        body["completed_at"] = 1_700_000_000.25
    return httpx.Response(200, json=body)


#: Per operation: the job id its POST or lookup yields, the POST's answers, then the GET answers of its job (the
#: last answer repeats). ``op-fenced`` comes last: its poll stays claimed, and no later round may observe it.
SCENARIO: dict[str, tuple[str, list[httpx.Response | Exception], list[httpx.Response]]] = {
    "op-ok": (
        "job-ok",
        [created("job-ok")],
        [job("job-ok", "queued"), job("job-ok", "running"), job("job-ok", "succeeded", 2)],
    ),
    "op-back": (
        "job-back",
        [created("job-back")],
        [job("job-back", "running"), job("job-back", "queued"), job("job-back", "failed")],
    ),
    "op-502": (
        "job-502",
        [httpx.Response(502, json={"error": {"job_id": "job-502"}})],
        [job("job-502", "succeeded", 1)],
    ),
    "op-400": ("-", [httpx.Response(400, json={"error": {"code": "invalid_request", "message": "no"}})], []),
    "op-429": (
        "job-429",
        [httpx.Response(429, headers={"Retry-After": "0"}), created("job-429")],
        [job("job-429", "canceled")],
    ),
    "op-timeout": ("-", [httpx.ReadTimeout("slow")], []),
    "op-lookup": ("job-lookup", [httpx.Response(503, json={})], [job("job-lookup", "succeeded", 1)]),
    "op-unknown": ("job-unknown", [created("job-unknown")], [job("job-unknown", "paused")]),
    "op-404": ("job-404", [created("job-404")], [httpx.Response(404, json={"error": {"code": "not_found"}})]),
    "op-fenced": ("job-fenced", [created("job-fenced")], [job("job-fenced", "succeeded", 1)]),
}
#: What a lookup by client reference finds, per operation.
LOOKUPS = {"op-lookup": ["job-lookup"], "op-timeout": []}


class ScriptedProvider:
    """Answers each POST by the operation it carries, each GET by its job id and each lookup from
    :data:`SCENARIO` and :data:`LOOKUPS`; ``during_get`` runs inside a GET, before its answer."""

    def __init__(self) -> None:
        self.posts = {op: list(posts) for op, (_, posts, _) in SCENARIO.items()}
        self.gets = {job_id: list(gets) for _, (job_id, _, gets) in SCENARIO.items()}
        self.during_get: Callable[[str], Awaitable[None]] | None = None

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            queue: list[Any] = self.posts[orjson.loads(request.content)["metadata"]["client_reference"]]
        elif "client_reference" in request.url.params:
            ids = LOOKUPS[request.url.params["client_reference"]]
            now_s = int(
                time.time()
            )  # a job created now: a job created before its operation was accepted is a former one's
            return httpx.Response(
                200, json={"data": [{"id": j, "status": "running", "created_at": now_s} for j in ids]}
            )
        else:
            job_id = request.url.path.rsplit("/", 1)[1]
            if self.during_get is not None:
                await self.during_get(job_id)
            queue = self.gets[job_id]
        answer: httpx.Response | Exception = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


async def run_scenario(settings: Settings, ledger: Any) -> dict[str, Any]:
    """Every operation of :data:`SCENARIO`, one after the other, to the end; returns what each stage sent."""
    provider = ScriptedProvider()
    sent = Sent()
    rt = Runtime(settings, ledger, fake_leases(settings), mock_remote(settings, provider), sent, "contract")
    dispatcher, observer = Dispatcher(rt), Observer(rt)
    scheduler, reconciler = PollScheduler(rt), Reconciler(rt)

    async def newer_claim(job_id: str) -> None:  # a second observer claims op-fenced while the first GETs
        if job_id == "job-fenced":
            provider.during_get = None
            await observed_again(ledger, "op-fenced")

    async def observe_round() -> None:
        before = len(sent.records)
        await scheduler.tick()
        for topic, key, value in sent.records[before:]:
            if topic == settings.topic("polls"):
                await observer.handle(RawMessage(topic, 0, 0, key, value))

    for op in SCENARIO:
        value = f'{{"operation_id": "{op}", "request": {REQUEST}, "submitted_at_ms": 1700000000000}}'
        await dispatcher.handle(RawMessage("generation.submissions", 0, 0, op.encode(), value.encode()))
        if (await ledger.get_operation(op))["state"] == "uncertain":
            assert await reconciler.tick() == 1
        if op == "op-fenced":
            provider.during_get = newer_claim
            await observe_round()  # the save is refused; the poll comes back only after the visibility timeout
            continue
        for _ in range(20):
            if OperationState((await ledger.get_operation(op))["state"]) not in POLLABLE:
                break
            await observe_round()
        else:
            raise AssertionError(f"{op} still pollable after 20 rounds")
    await ledger.reconcile_stale_submitting(0.0, 100)  # nothing left in submitting
    relay = OutboxRelay(rt)
    await relay.tick()
    published = [
        (topic, key.decode(), orjson.loads(value)["event_id"])
        for topic, key, value in sent.records
        if topic != settings.topic("polls")
    ]
    await rt.remote.aclose()
    return {"published": published}


async def real_records(pool: asyncpg.Pool) -> dict[str, Any]:
    ops = await pool.fetch(
        "SELECT operation_id, state::text AS state, remote_job_id, fencing_token, reason, reason_code, poll_count, "
        "unknown_status_count, lookup_count FROM operations ORDER BY operation_id"
    )
    transitions = await pool.fetch(
        "SELECT operation_id, seq, from_state::text AS from_state, to_state::text AS to_state, fencing_token, reason "
        "FROM transitions ORDER BY operation_id, seq"
    )
    outbox = await pool.fetch(
        "SELECT event_id, topic_role, published_at IS NOT NULL AS published FROM outbox ORDER BY operation_id, id"
    )
    calls = await pool.fetch(
        "SELECT operation_id, method, status_code, outcome, remote_job_id, fencing_token FROM remote_calls "
        "ORDER BY operation_id, id"
    )
    return {
        "operations": [tuple(r) for r in ops],
        "transitions": [tuple(r) for r in transitions],
        "outbox": [tuple(r) for r in outbox],
        "calls": [tuple(r) for r in calls],
    }


def fake_records(ledger: InMemoryLedger) -> dict[str, Any]:
    ops = sorted(ledger.operations.values(), key=lambda o: o.operation_id)
    transitions = sorted(ledger.transitions, key=lambda t: (t.operation_id, t.seq))
    return {
        "operations": [
            (
                o.operation_id,
                o.state.value,
                o.remote_job_id,
                o.fencing_token,
                o.reason,
                o.reason_code,
                o.poll_count,
                o.unknown_status_count,
                o.lookup_count,
            )
            for o in ops
        ],
        "transitions": [
            (t.operation_id, t.seq, t.from_state and t.from_state.value, t.to_state.value, t.fencing_token, t.reason)
            for t in transitions
        ],
        "outbox": [
            (r.event_id, r.topic_role, r.published) for r in sorted(ledger.outbox, key=lambda r: (r.operation_id, r.id))
        ],
        "calls": [
            (c.operation_id, c.method, c.status_code, c.outcome, c.remote_job_id, c.fencing_token)
            for c in sorted(ledger.remote_calls, key=lambda c: c.operation_id)
        ],
    }


async def test_the_fake_ledger_decides_as_the_real_one(migrated: Settings, pool: asyncpg.Pool) -> None:
    settings = migrated.replace(
        remote_base_url="http://provider.test",
        remote_allow_plain_http=True,
        poll_min_delay_s=0.0,
        poll_backoff_base_s=0.0,
        not_found_grace_s=0.0,
        unknown_status_limit=2,
        lookup_enabled=True,
        lookup_lag_s=0.0,
        coordination_retry_cap_s=0.05,
        visibility_timeout_s=600.0,
    )
    fake = InMemoryLedger()
    fake_sent = await run_scenario(settings, fake)
    real_sent = await run_scenario(settings, Ledger(pool, "contract"))
    real, faked = await real_records(pool), fake_records(fake)
    for table in ("operations", "transitions", "outbox", "calls"):
        assert faked[table] == real[table], table
    assert fake_sent == real_sent
    states = {row[0]: row[1] for row in real["operations"]}
    assert states == {
        "op-ok": "succeeded",
        "op-back": "failed",
        "op-502": "succeeded",
        "op-400": "rejected",
        "op-429": "canceled",
        "op-timeout": "uncertain",
        "op-lookup": "succeeded",
        "op-unknown": "stalled",
        "op-404": "stalled",
        "op-fenced": "submitted",
    }
    fenced = [row for row in real["calls"] if row[0] == "op-fenced"]
    assert [(c[1], c[3], c[5]) for c in fenced] == [("POST", "created", 1), ("GET", "succeeded", 2)]
    assert [row[1:] for row in real["operations"] if row[0] == "op-fenced"] == [
        ("submitted", "job-fenced", 3, None, None, 0, 0, 0)
    ]


@pytest.mark.skipif(
    not hasattr(Dispatcher, "redispatch"), reason="re-dispatch of operations left accepted is not in this tree"
)
async def test_an_operation_left_accepted_is_found_and_dispatched_again_alike(
    migrated: Settings, pool: asyncpg.Pool
) -> None:
    """An operation whose dispatcher died after accepting it: ``stale_accepted`` finds it on both ledgers and the
    re-dispatch leaves the same records."""
    settings = migrated.replace(
        remote_base_url="http://provider.test", remote_allow_plain_http=True, coordination_retry_cap_s=0.05
    )
    fake = InMemoryLedger()
    for ledger in (fake, Ledger(pool, "contract")):
        provider = ScriptedProvider()
        rt = Runtime(settings, ledger, fake_leases(settings), mock_remote(settings, provider), Sent(), "contract")
        assert await ledger.accept("op-ok", REQUEST, submitted_at_ms=1700000000000)
        assert await ledger.stale_accepted(0.0, 100) == [("op-ok", REQUEST)]
        assert await Dispatcher(rt).redispatch("op-ok", REQUEST) is True
        assert await ledger.stale_accepted(0.0, 100) == []
        await rt.remote.aclose()
    real, faked = await real_records(pool), fake_records(fake)
    assert faked == real
    assert [row[1:3] for row in real["operations"]] == [("submitted", "job-ok")]


#: What happens between an observer's claim of a poll and the same claim sent again (its reply lost), and what the
#: repeat gets: the claim it wrote (fencing value, state, poll count) or None.
BETWEEN_CLAIM_AND_REPEAT: dict[str, tuple[str, ...]] = {
    "nothing": (),  # the lost reply alone
    "another claim of the poll": ("claim_other",),  # a redelivered poll event on another worker: refused
    "the poll rescheduled": ("reschedule",),  # that other worker found the lease busy
    "the poll claimed again": ("reschedule", "claim_due"),  # a newer scheduler claim: the repeat's poll is stale
    "a terminal save": ("save_failed",),
    "stalled": ("save_stalled",),
}
REPEAT_GETS: dict[str, tuple[int, str, int] | None] = {
    "nothing": (2, "submitted", 0),
    "another claim of the poll": (2, "submitted", 0),
    "the poll rescheduled": (2, "submitted", 0),
    "the poll claimed again": None,
    "a terminal save": None,
    "stalled": None,
}


async def _claim_then_repeat(ledger: Any, between: tuple[str, ...]) -> list[Any]:
    """An operation submitted and its poll claimed, an observer's claim, ``between``, then the same claim twice
    more; what each call answered, and the row's fencing value, state and poll claim id at the end."""
    op, claim_id = "op-repeat", uuid.uuid4()
    assert await ledger.accept(op, REQUEST, submitted_at_ms=1)
    fencing = await ledger.claim_for_submit(op)
    assert await ledger.save_submitted(op, fencing, "job-repeat", 0.0, None)
    (poll,) = await ledger.claim_due_polls(100, 3600.0)

    def seen(claim: ObserveClaim | None) -> tuple[int, str, int] | None:
        return None if claim is None else (claim.fencing_token, str(claim.state), claim.poll_count)

    answers: list[Any] = [seen(await ledger.claim_for_observe(op, poll.poll_claim_id, claim_id))]
    failed = JobSnapshot(job_id="job-repeat", status="failed", state=OperationState.FAILED)
    for step in between:
        if step == "claim_other":
            answers.append(seen(await ledger.claim_for_observe(op, poll.poll_claim_id, uuid.uuid4())))
        elif step == "reschedule":
            answers.append(await ledger.reschedule_poll(op, poll.poll_claim_id, 0.0))
        elif step == "claim_due":
            answers.append([p.poll_claim_id for p in await ledger.claim_due_polls(100, 3600.0)])
        elif step == "save_failed":
            answers.append(str(await ledger.save_observation(op, 2, failed, None)))
        elif step == "save_stalled":
            answers.append(await ledger.save_stalled(op, 2, "no progress", {"status": "running"}))
    for _ in range(2):
        answers.append(seen(await ledger.claim_for_observe(op, poll.poll_claim_id, claim_id)))
    row = await ledger.get_operation(op)
    answers.append((row["fencing_token"], row["state"], row["poll_claim_id"]))
    return answers


@pytest.mark.parametrize("case", list(BETWEEN_CLAIM_AND_REPEAT))
async def test_an_observer_claim_sent_again_reads_alike_on_both_ledgers(pool: asyncpg.Pool, case: str) -> None:
    """The repeat of an observer's claim (the same claim id) after whatever may happen while its reply is lost:
    the same answers from the fake as from PostgreSQL, and the repeat never writes."""
    between = BETWEEN_CLAIM_AND_REPEAT[case]
    real = await _claim_then_repeat(Ledger(pool, "contract", batching=False), between)
    faked = await _claim_then_repeat(InMemoryLedger(worker="contract"), between)
    assert faked == real
    assert real[0] == (2, "submitted", 0)
    assert real[-3] == real[-2] == REPEAT_GETS[case]
    assert real[-1][0] == 2  # one claim wrote a fencing value; no repeat wrote another


async def test_a_callback_makes_a_poll_due_alike_on_both_ledgers(pool: asyncpg.Pool) -> None:
    async def story(ledger: Any) -> list[tuple[str | None, bool, bool]]:
        assert await ledger.accept("op-cb", REQUEST, submitted_at_ms=0)
        fencing = await ledger.claim_for_submit("op-cb")
        assert await ledger.save_submitted("op-cb", fencing, "job-cb", 3600.0, None)
        notes = [await ledger.note_callback("msg-1", "job-cb")]  # due in an hour: made due now
        notes.append(await ledger.note_callback("msg-1", "job-cb"))  # a replay: nothing
        notes.append(await ledger.note_callback("msg-2", "job-cb"))  # due already: recorded, nothing changed
        notes.append(await ledger.note_callback("msg-3", "job-nobody"))  # unknown job: nothing recorded
        [claimed] = await ledger.claim_due_polls(10, 30.0)
        assert claimed.operation_id == "op-cb"
        notes.append(await ledger.note_callback("msg-4", "job-cb"))  # claimed, not yet taken: nothing changed
        return [(n.operation_id, n.recorded, n.made_due) for n in notes]

    real = await story(Ledger(pool, "test"))
    assert real == [
        ("op-cb", True, True),
        ("op-cb", False, False),
        ("op-cb", True, False),
        (None, False, False),
        ("op-cb", True, False),
    ]
    assert await story(InMemoryLedger()) == real


async def test_poll_setbacks_count_and_stall_alike_on_both_ledgers(pool: asyncpg.Pool) -> None:
    """``note_poll_setback`` of either kind, interleaved: the same counts, states, reasons and last observations
    from the fake as from PostgreSQL; a reason code that is no poll setback is refused by both."""
    unknown, failed = {"status": "paused"}, {"error": "HTTP 502", "http_status": 502}
    steps = [ReasonCode.UNKNOWN_STATUS, ReasonCode.POLL_FAILURES, ReasonCode.UNKNOWN_STATUS, ReasonCode.POLL_FAILURES]

    async def story(ledger: Any) -> list[Any]:
        assert await ledger.accept("op-setback", REQUEST, submitted_at_ms=0)
        fencing = await ledger.claim_for_submit("op-setback")
        assert await ledger.save_submitted("op-setback", fencing, "job-setback", 0.0, None)
        with pytest.raises(ValueError, match="max_age is not a poll setback"):
            await ledger.note_poll_setback("op-setback", fencing, ReasonCode.MAX_AGE, 3, 60.0, "m", unknown)
        seen: list[Any] = []
        for setback in steps:
            answer = unknown if setback is ReasonCode.UNKNOWN_STATUS else failed
            noted = await ledger.note_poll_setback("op-setback", fencing, setback, 2, 60.0, f"r {setback}", answer)
            row = await ledger.get_operation("op-setback")
            seen.append((noted, row["reason"], row["last_observation"], row["poll_count"]))
        return seen

    real = await story(Ledger(pool, "contract", batching=False))
    assert real == [
        ((OperationState.SUBMITTED, 1), None, unknown, 1),
        ((OperationState.SUBMITTED, 1), None, unknown, 2),  # a failure keeps the last observation
        ((OperationState.STALLED, 2), "r unknown_status", unknown, 3),
        (None, "r unknown_status", unknown, 3),  # stalled: no longer pollable
    ]
    assert await story(InMemoryLedger(worker="contract")) == real


async def test_a_first_poll_claimed_by_the_job_id_save_reads_alike_on_both_ledgers(pool: asyncpg.Pool) -> None:
    """``save_submitted`` with a first poll claim id: the observer's claim taken by the save (a new fencing value
    and poll claim, not due for the scheduler before its delay), the same claim again for a repeat, none once a
    newer claim was taken, and none with a cancellation recorded (the poll due at once, the fencing value kept);
    the same answers from the fake as from PostgreSQL."""

    def seen(saved: bool | FirstPollClaim) -> Any:
        if isinstance(saved, FirstPollClaim):
            c = saved.claim
            return (saved.poll_claim_id, c.fencing_token, c.remote_job_id, str(c.state), c.poll_count, c.cancel_asked)
        return saved

    async def story(ledger: Any) -> list[Any]:
        claim_id = uuid.uuid4()
        assert await ledger.accept("op-first", REQUEST, submitted_at_ms=0)
        fencing = await ledger.claim_for_submit("op-first")
        answers = [
            seen(
                await ledger.save_submitted("op-first", fencing, "job-first", 60.0, None, first_poll_claim_id=claim_id)
            )
        ]
        answers.append(
            seen(
                await ledger.save_submitted("op-first", fencing, "job-first", 60.0, None, first_poll_claim_id=claim_id)
            )
        )
        answers.append([p.operation_id for p in await ledger.claim_due_polls(10, 30.0)])  # due in 60 s: not claimed
        answers.append(await ledger.reschedule_poll("op-first", 1, 0.0))  # given back: due now
        answers.append([(p.operation_id, p.poll_claim_id) for p in await ledger.claim_due_polls(10, 30.0)])
        answers.append(
            seen(
                await ledger.save_submitted("op-first", fencing, "job-first", 60.0, None, first_poll_claim_id=claim_id)
            )
        )
        assert await ledger.accept("op-asked", REQUEST, submitted_at_ms=0)
        fencing = await ledger.claim_for_submit("op-asked")
        await ledger.request_cancel("op-asked", CancelPath.OPERATOR, "alice", "not needed")
        answers.append(
            seen(
                await ledger.save_submitted(
                    "op-asked", fencing, "job-asked", 60.0, None, first_poll_claim_id=uuid.uuid4()
                )
            )
        )
        answers.append([p.operation_id for p in await ledger.claim_due_polls(10, 30.0)])  # due at once
        row = await ledger.get_operation("op-asked")
        answers.append((row["fencing_token"], row["poll_claim_id"]))
        return answers

    real = await story(Ledger(pool, "contract", batching=False))
    assert real == [
        (1, 2, "job-first", "submitted", 0, False),  # claimed: fencing 1 -> 2, poll claim 0 -> 1
        (1, 2, "job-first", "submitted", 0, False),  # the same save again: the same claim, nothing written
        [],
        True,
        [("op-first", 2)],
        True,  # a scheduler claimed the poll since: saved, not this save's poll any more
        True,
        ["op-asked"],
        (1, 1),  # the scheduler's claim only: the save took no observer claim
    ]
    assert await story(InMemoryLedger(worker="contract")) == real
