"""The pipeline's decisions in milliseconds: dispatcher, observer (with its stall rules), poll scheduler (with the
reconciliation of stale ``submitting``), reconciler and outbox relay over the in-memory ledger
(:mod:`tests.fakes`), leases on an in-process Redis running the real Lua scripts, and the real
:class:`~streams.remote.client.RemoteClient` answered by an ``httpx.MockTransport``.

The same rules are checked against PostgreSQL in ``tests/integration``; ``test_fake_ledger_contract.py`` there
runs one scenario on both ledgers and compares them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import fakeredis
import httpx
import orjson
import pytest
from prometheus_client import REGISTRY

from streams.config import Settings, budget_key
from streams.errors import LedgerDataError
from streams.model.codes import ReasonCode
from streams.model.states import OperationState
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from streams.worker.stages.reconciler import Reconciler
from streams.worker.stages.relay import OutboxRelay
from streams.worker.stages.scheduler import NOT_READ, PollScheduler
from tests.fakes import InMemoryLedger, Sent, fake_leases, fake_runtime, observed_again
from tests.support import wait_for

S = OperationState
R = ReasonCode
OP = "op-1"
JOB = "job_1"
REQUEST = '{"input": {"prompt": "hello", "max_tokens": 4}}'

Answer = httpx.Response | Exception


class Provider:
    """A scripted remote API: each POST, GET of a job, or lookup takes the next answer of its list (the last one
    repeats); every request is recorded."""

    def __init__(
        self,
        posts: list[Answer] | None = None,
        gets: list[Answer] | None = None,
        lookups: list[Answer] | None = None,
    ) -> None:
        self.answers: dict[str, list[Answer]] = {
            "POST": posts or [created()],
            "GET": gets or [job("running")],
            "LOOKUP": lookups or [found()],
        }
        self.requests: list[httpx.Request] = []
        self.on_request: Callable[[str], Any] | None = None

    def count(self, kind: str) -> int:
        return sum(1 for r in self.requests if _kind(r) == kind)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        kind = _kind(request)
        if self.on_request is not None:
            await self.on_request(kind)
        queue = self.answers[kind]
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def _kind(request: httpx.Request) -> str:
    if request.method == "POST":
        return "POST"
    return "LOOKUP" if "client_reference" in request.url.params else "GET"


def created(job_id: str = JOB, status: int = 201, poll_after_ms: int = 0) -> httpx.Response:
    return httpx.Response(status, json={"id": job_id, "status": "queued", "poll_after_ms": poll_after_ms})


def job(status: str | None, job_id: str = JOB, **extra: Any) -> httpx.Response:
    return httpx.Response(200, json={"id": job_id, "status": status, **extra})


def succeeded(job_id: str = JOB, outputs: int = 2) -> httpx.Response:
    outs = [{"id": f"out_{i}", "index": i, "text": f"text {i}"} for i in range(outputs)]
    return job("succeeded", job_id, outputs=outs, completed_at=1_700_000_000.5)


def found(*job_ids: str) -> httpx.Response:
    return httpx.Response(
        200,
        json={"data": [{"id": j, "status": "running", "created_at": 1_700_000_000 + i} for i, j in enumerate(job_ids)]},
    )


def submission(op: str = OP, request: str = REQUEST) -> RawMessage:
    value = f'{{"operation_id": "{op}", "request": {request}, "submitted_at_ms": {int(time.time() * 1000)}}}'
    return RawMessage("generation.submissions", 0, 7, op.encode(), value.encode())


@pytest.fixture
def settings(base_settings: Settings) -> Settings:
    return base_settings.replace(
        remote_base_url="http://provider.test",
        remote_allow_plain_http=True,
        poll_min_delay_s=0.0,
        submitting_stale_after_s=30.0,
        not_found_grace_s=10.0,
        unknown_status_limit=3,
        max_observation_age_s=600.0,
        lookup_enabled=True,
        lookup_lag_s=5.0,
        coordination_retry_cap_s=0.05,
    )


class Pipeline:
    """One worker's stages over the fakes, and the ledger and sent records to assert on."""

    def __init__(self, settings: Settings, provider: Provider, redis: fakeredis.FakeServer | None = None) -> None:
        self.ledger = InMemoryLedger()
        self.provider = provider
        self.redis = redis or fakeredis.FakeServer()
        self.rt: Runtime = fake_runtime(settings, provider, self.ledger, fake_leases(settings, self.redis))
        assert isinstance(self.rt.send, Sent)  # what fake_runtime gives
        self.sent = self.rt.send
        self.dispatcher = Dispatcher(self.rt)
        self.observer = Observer(self.rt)
        self.scheduler = PollScheduler(self.rt)
        self.reconciler = Reconciler(self.rt)
        self.relay = OutboxRelay(self.rt)

    async def observe_due(self) -> int:
        """One scheduler round, then every poll event it published handled by the observer."""
        before = len(self.sent.records)
        claimed = await self.scheduler.tick()
        polls_topic = self.rt.settings.topic("polls")
        for topic, key, value in self.sent.records[before:]:
            if topic == polls_topic:
                await self.observer.handle(RawMessage(topic, 0, 0, key, value))
        return claimed

    def states(self, op: str = OP) -> list[OperationState]:
        return [t.to_state for t in self.ledger.transitions if t.operation_id == op]


@pytest.fixture
def pipeline(settings: Settings) -> Callable[..., Pipeline]:
    """``pipeline(provider)``: a fresh :class:`Pipeline` answered by ``provider`` (default: created, running)."""

    def make(provider: Provider | None = None) -> Pipeline:
        return Pipeline(settings, provider or Provider())

    return make


# --- dispatcher ----------------------------------------------------------------------------------------------


async def test_created_job_is_saved_and_a_replay_posts_nothing(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline(Provider(posts=[created(poll_after_ms=1500)]))
    await p.dispatcher.handle(submission())
    await p.dispatcher.handle(submission())  # Kafka redelivery
    op = p.ledger.operations[OP]
    assert (op.state, op.remote_job_id, op.reason) == (S.SUBMITTED, JOB, None)
    assert op.next_poll_at is not None and op.next_poll_at - op.updated_at == pytest.approx(1.5, abs=1e-6)
    assert p.states() == [S.ACCEPTED, S.SUBMITTING, S.SUBMITTED]
    assert p.provider.count("POST") == 1
    assert [(c.method, c.status_code, c.outcome, c.remote_job_id) for c in p.ledger.remote_calls] == [
        ("POST", 201, "created", JOB)
    ]
    body = orjson.loads(p.provider.requests[0].content)
    assert body["metadata"] == {"client_reference": OP}


@pytest.mark.parametrize(
    ("answer", "state", "code", "reason_part"),
    [
        (httpx.Response(502, json={"error": {"job_id": "job_502"}}), S.SUBMITTED, R.JOB_ID_VIA_ERROR, "HTTP 502"),
        (httpx.Response(503, json={"error": {"code": "x"}}), S.UNCERTAIN, R.UNKNOWN_OUTCOME, "HTTP 503 without"),
        (httpx.ReadTimeout("slow"), S.UNCERTAIN, R.UNKNOWN_OUTCOME, "POST timed out after send"),
        (httpx.RemoteProtocolError("dropped"), S.UNCERTAIN, R.UNKNOWN_OUTCOME, "connection lost after send"),
        (httpx.Response(400, json={"error": {"code": "invalid_request"}}), S.REJECTED, R.REFUSED, "HTTP 400"),
        (httpx.Response(201, json={"id": "bad id!"}), S.UNCERTAIN, R.UNKNOWN_OUTCOME, "without a usable job id"),
    ],
)
async def test_each_post_answer_decides_the_next_state_with_one_post(
    pipeline: Callable[..., Pipeline], answer: Answer, state: OperationState, code: ReasonCode, reason_part: str
) -> None:
    p = pipeline(Provider(posts=[answer]))
    await p.dispatcher.handle(submission())
    op = p.ledger.operations[OP]
    assert (op.state, op.reason_code) == (state, code)
    assert op.reason is not None and reason_part in op.reason
    assert p.provider.count("POST") == 1
    assert p.states() == [S.ACCEPTED, S.SUBMITTING, state]


@pytest.mark.parametrize(
    "first",
    [httpx.Response(429, headers={"Retry-After": "0"}, json={}), httpx.ConnectError("refused")],
    ids=["429", "not sent"],
)
async def test_rate_limited_or_not_sent_is_retried_into_one_job(
    pipeline: Callable[..., Pipeline], first: Answer
) -> None:
    p = pipeline(Provider(posts=[first, created()]))
    await p.dispatcher.handle(submission())
    assert p.ledger.state(OP) is S.SUBMITTED
    assert p.provider.count("POST") == 2
    first_outcome = "rate_limited" if isinstance(first, httpx.Response) else "not_sent"
    assert [c.outcome for c in p.ledger.remote_calls] == [first_outcome, "created"]


async def test_rate_limited_past_the_deadline_is_rejected(settings: Settings) -> None:
    p = Pipeline(settings.replace(submit_retry_deadline_s=0.0), Provider(posts=[httpx.Response(429, json={})]))
    await p.dispatcher.handle(submission())
    assert p.ledger.state(OP) is S.REJECTED
    assert p.provider.count("POST") == 1


async def test_rate_limited_beyond_the_deadline_is_rejected_at_once(settings: Settings) -> None:
    # A 429 whose Retry-After ends past the retry deadline: no POST can follow within it, so the operation ends
    # rejected for the 429 right away (not after waiting out the deadline, blamed on the rate budget).
    answer = httpx.Response(429, headers={"Retry-After": "100"}, json={})
    p = Pipeline(settings.replace(submit_retry_deadline_s=2.0), Provider(posts=[answer, created()]))
    started = time.monotonic()
    await p.dispatcher.handle(submission())
    op = p.ledger.operations[OP]
    assert (op.state, op.reason_code) == (S.REJECTED, R.RATE_LIMITED)
    assert p.provider.count("POST") == 1
    assert time.monotonic() - started < 1.5


async def test_an_operation_reconciled_while_a_retry_waits_is_not_posted_again(settings: Settings) -> None:
    # A 429, then, during its Retry-After, the reconciliation turns the stuck ``submitting`` into ``uncertain``:
    # the retry finds the operation no longer ours under its fencing value and sends nothing.
    p = Pipeline(settings, Provider(posts=[httpx.Response(429, headers={"Retry-After": "0.5"}, json={}), created()]))

    async def reconcile_while_waiting(kind: str) -> None:
        async def reconcile() -> None:
            await asyncio.sleep(0.1)
            p.ledger.advance(3600)
            assert await p.ledger.reconcile_stale_submitting(settings.submitting_stale_after_s, 10) == [OP]

        asyncio.get_running_loop().create_task(reconcile())

    p.provider.on_request = reconcile_while_waiting
    await p.dispatcher.handle(submission())
    assert p.provider.count("POST") == 1
    assert p.ledger.state(OP) is S.UNCERTAIN
    assert p.states() == [S.ACCEPTED, S.SUBMITTING, S.UNCERTAIN]


async def test_a_conflicting_replay_is_dead_lettered_and_posts_nothing(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline()
    await p.dispatcher.handle(submission())
    await p.dispatcher.handle(submission(request='{"input": {"prompt": "other", "max_tokens": 4}}'))
    [letter] = p.sent.values(p.rt.settings.topic("dead_letter"))
    assert (letter["reason"], letter["offset"]) == ("conflicting_duplicate", 7)
    assert p.provider.count("POST") == 1


async def test_no_claim_and_no_post_while_redis_is_down(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline()
    p.redis.connected = False
    before = _redis_unavailable("submit")
    handling = asyncio.create_task(p.dispatcher.handle(submission()))

    async def waited_twice() -> bool:
        return _redis_unavailable("submit") >= before + 2

    await wait_for(waited_twice, 5, "the dispatcher to find Redis down twice")
    assert p.ledger.state(OP) is S.ACCEPTED and p.provider.count("POST") == 0
    p.redis.connected = True
    await asyncio.wait_for(handling, 5)
    assert p.ledger.state(OP) is S.SUBMITTED and p.provider.count("POST") == 1


def _redis_unavailable(action: str) -> float:
    return REGISTRY.get_sample_value("streams_coordination_unavailable_total", {"action": action}) or 0.0


async def test_a_late_answer_saves_the_job_over_uncertain(pipeline: Callable[..., Pipeline]) -> None:
    """The reconciliation turns the stuck ``submitting`` into ``uncertain`` while the POST is still out; the
    same POST's answer then saves its job (same fencing value: ``uncertain -> submitted``)."""
    p = pipeline()

    async def reconcile_meanwhile(kind: str) -> None:
        p.ledger.advance(p.rt.settings.submitting_stale_after_s + 1)
        assert await p.ledger.reconcile_stale_submitting(p.rt.settings.submitting_stale_after_s, 10) == [OP]

    p.provider.on_request = reconcile_meanwhile
    await p.dispatcher.handle(submission())
    assert p.states() == [S.ACCEPTED, S.SUBMITTING, S.UNCERTAIN, S.SUBMITTED]
    assert p.ledger.operations[OP].remote_job_id == JOB


async def test_a_save_with_an_older_fencing_value_touches_nothing(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline()
    await p.ledger.accept(OP, REQUEST, submitted_at_ms=1)
    old = await p.ledger.claim_for_submit(OP)
    assert old == 1
    await p.ledger.reconcile_stale_submitting(-1.0, 10)  # uncertain, fencing value kept
    claim = (await p.ledger.claim_due_lookups(10, -1.0, 60.0))[0]  # a newer claim: fencing value 2
    assert claim.fencing_token == 2
    before = p.ledger.operations[OP]
    assert not await p.ledger.save_submitted(OP, old, JOB, 0.0, None)
    assert not await p.ledger.save_submission_without_job(OP, old, S.REJECTED, "late", ReasonCode.REFUSED)
    assert p.ledger.operations[OP] == before


# --- scheduler and reconciliation ----------------------------------------------------------------------------


async def test_due_polls_are_claimed_once_and_published(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline(Provider(posts=[created(poll_after_ms=2000)]))
    await p.dispatcher.handle(submission())
    assert await p.scheduler.tick() == 0  # not due for 2 s
    p.ledger.advance(2.0)
    assert await p.scheduler.tick() == 1
    assert await p.scheduler.tick() == 0  # claimed: back only after the visibility timeout
    [poll] = p.sent.values(p.rt.settings.topic("polls"))
    assert (poll["operation_id"], poll["remote_job_id"], poll["poll_claim_id"]) == (OP, JOB, 1)
    p.ledger.advance(p.rt.settings.visibility_timeout_s)
    assert await p.scheduler.tick() == 1  # the lost poll came back
    assert [v["poll_claim_id"] for v in p.sent.values(p.rt.settings.topic("polls"))] == [1, 2]


async def test_no_polls_claimed_while_redis_is_down(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline()
    await p.dispatcher.handle(submission())
    p.redis.connected = False
    assert await p.scheduler.tick() == 0
    assert p.ledger.operations[OP].poll_claim_id == 0
    p.redis.connected = True
    assert await p.scheduler.tick() == 1


async def test_a_round_that_claims_reads_the_next_poll_due_in_its_claim(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline(Provider(posts=[created(poll_after_ms=2000)]))
    await p.dispatcher.handle(submission())
    assert await p.scheduler.tick() == 0
    assert isinstance(p.scheduler.next_due, float)  # read by the claim: run() sleeps on it
    assert p.scheduler.next_due == pytest.approx(2.0, abs=0.5)
    p.ledger.advance(2.0)
    assert await p.scheduler.tick() == 1
    assert isinstance(p.scheduler.next_due, float)
    assert p.scheduler.next_due == pytest.approx(p.rt.settings.visibility_timeout_s, abs=0.5)
    p.redis.connected = False  # no claim made: nothing read, run() asks the ledger itself
    assert await p.scheduler.tick() == 0
    unread: object = p.scheduler.next_due  # (mypy keeps the float read above)
    assert unread is NOT_READ


async def test_stale_submitting_becomes_uncertain_only_past_the_window(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline()
    await p.ledger.accept(OP, REQUEST, submitted_at_ms=1)
    await p.ledger.claim_for_submit(OP)  # the dispatcher died before the POST's outcome was saved
    await p.scheduler.tick()
    assert p.ledger.state(OP) is S.SUBMITTING
    p.ledger.advance(p.rt.settings.submitting_stale_after_s + 0.1)
    await PollScheduler(p.rt).tick()  # a fresh scheduler: each reconciles at most once a second of real time
    op = p.ledger.operations[OP]
    assert op.state is S.UNCERTAIN
    assert op.reason is not None and op.reason.startswith("no outcome saved within 30 s of submitting")
    assert p.provider.count("POST") == 0  # never resubmitted


#: Re-dispatch of operations left ``accepted`` comes with the scheduler's ``stale_accepted`` round.
needs_redispatch = pytest.mark.skipif(
    not hasattr(Dispatcher, "redispatch"), reason="re-dispatch of operations left accepted is not in this tree"
)


@needs_redispatch
async def test_an_operation_left_accepted_is_dispatched_again_once_past_the_window(
    pipeline: Callable[..., Pipeline],
) -> None:
    p = pipeline()
    await p.ledger.accept(OP, REQUEST, submitted_at_ms=1)  # its dispatcher died before the claim
    await PollScheduler(p.rt).tick()
    assert p.ledger.state(OP) is S.ACCEPTED  # inside the window: left to the dispatcher handling it
    p.ledger.advance(p.rt.settings.accepted_stale_after_s + 0.1)
    scheduler = PollScheduler(p.rt)
    await scheduler.tick()
    assert await asyncio.gather(*scheduler.redispatching.values()) == [True]
    assert p.states() == [S.ACCEPTED, S.SUBMITTING, S.SUBMITTED]
    assert p.provider.count("POST") == 1
    body = orjson.loads(p.provider.requests[0].content)
    assert body == {
        "input": {"prompt": "hello", "max_tokens": 4},
        "metadata": {"client_reference": OP},
        "model": p.rt.settings.remote_model,
    }


@needs_redispatch
async def test_no_redispatch_while_a_dispatcher_holds_the_submit_lease(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline()
    await p.ledger.accept(OP, REQUEST, submitted_at_ms=1)
    live = await p.rt.leases.acquire(f"{p.rt.settings.lease_key_prefix}:submit:{OP}")
    assert live is not None
    p.ledger.advance(p.rt.settings.accepted_stale_after_s + 0.1)
    scheduler = PollScheduler(p.rt)
    await scheduler.tick()
    assert await asyncio.gather(*scheduler.redispatching.values()) == [False]
    assert p.ledger.state(OP) is S.ACCEPTED and p.provider.count("POST") == 0


# --- observer ------------------------------------------------------------------------------------------------


async def test_observed_to_succeeded_with_one_outbox_row_per_output(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline(Provider(gets=[job("queued"), job("running"), succeeded(outputs=2)]))
    await p.dispatcher.handle(submission())
    for _ in range(3):
        p.ledger.advance(60.0)
        assert await p.observe_due() == 1
    assert p.states() == [S.ACCEPTED, S.SUBMITTING, S.SUBMITTED, S.QUEUED, S.RUNNING, S.SUCCEEDED]
    op = p.ledger.operations[OP]
    assert (op.next_poll_at, op.poll_count, op.remote_completed_at_ms) == (None, 3, 1_700_000_000_500)
    p.ledger.advance(60.0)
    assert await p.observe_due() == 0  # terminal: never polled again
    assert p.provider.count("GET") == 3
    outputs = [r.event_id for r in p.ledger.outbox if r.topic_role == "outputs_delivered"]
    assert outputs == [f"output:{OP}:out_0", f"output:{OP}:out_1"]


async def test_a_status_going_back_is_refused_by_the_state_order_and_polled_again(
    pipeline: Callable[..., Pipeline],
) -> None:
    p = pipeline(Provider(gets=[job("running"), job("queued"), succeeded()]))
    await p.dispatcher.handle(submission())
    for _ in range(3):
        p.ledger.advance(60.0)
        await p.observe_due()
    assert p.states() == [S.ACCEPTED, S.SUBMITTING, S.SUBMITTED, S.RUNNING, S.SUCCEEDED]


async def test_an_observation_under_an_older_fencing_value_is_dropped(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline(Provider(gets=[succeeded()]))
    await p.dispatcher.handle(submission())

    async def newer_claim_meanwhile(kind: str) -> None:  # a second observer claimed the operation during the GET
        if kind == "GET":
            await observed_again(p.ledger, OP)

    p.provider.on_request = newer_claim_meanwhile
    p.ledger.advance(60.0)
    await p.observe_due()
    op = p.ledger.operations[OP]
    assert (op.state, op.last_observation, op.fencing_token) == (S.SUBMITTED, None, 3)
    assert [r for r in p.ledger.outbox if r.topic_role == "outputs_delivered"] == []


async def test_a_poll_whose_lease_is_held_is_rescheduled_without_a_get(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline()
    await p.dispatcher.handle(submission())
    other = await p.rt.leases.acquire(f"{p.rt.settings.lease_key_prefix}:observe:{OP}")
    assert other is not None
    p.ledger.advance(60.0)
    await p.observe_due()
    op = p.ledger.operations[OP]
    assert p.provider.count("GET") == 0
    assert op.next_poll_at is not None
    assert op.next_poll_at - op.updated_at == pytest.approx(p.rt.settings.lease_busy_retry_s, abs=1e-6)


async def test_a_failed_get_is_rescheduled_with_backoff(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline(Provider(gets=[httpx.Response(500), job("running")]))
    await p.dispatcher.handle(submission())
    p.ledger.advance(60.0)
    await p.observe_due()
    op = p.ledger.operations[OP]
    assert op.state is S.SUBMITTED
    assert op.next_poll_at is not None and op.next_poll_at > op.updated_at
    assert [c.outcome for c in p.ledger.remote_calls if c.method == "GET"] == ["transient"]
    assert (op.poll_count, op.failed_poll_count) == (1, 1)  # counted: the next failure backs off further
    p.ledger.advance(60.0)
    await p.observe_due()
    assert p.ledger.state(OP) is S.RUNNING


# --- stall rules ---------------------------------------------------------------------------------------------


async def test_not_found_is_rescheduled_inside_the_grace_window_and_stalls_past_it(
    pipeline: Callable[..., Pipeline],
) -> None:
    p = pipeline(Provider(gets=[httpx.Response(404, json={"error": {"code": "not_found"}})]))
    await p.dispatcher.handle(submission())
    await p.observe_due()
    assert p.ledger.state(OP) is S.SUBMITTED
    p.ledger.advance(p.rt.settings.not_found_grace_s + 1)
    await p.observe_due()
    op = p.ledger.operations[OP]
    assert op.state is S.STALLED and op.next_poll_at is None
    assert op.reason is not None and op.reason.startswith("not found (404) more than 10 s after the job id was saved")
    assert op.last_observation is not None and op.last_observation == {
        "http_status": 404,
        "body": '{"error":{"code":"not_found"}}',
    }
    assert p.provider.count("GET") == 2


async def test_an_unknown_status_stalls_at_the_limit_and_a_known_one_resets_the_count(
    pipeline: Callable[..., Pipeline],
) -> None:
    p = pipeline(
        Provider(gets=[job("paused"), job("paused"), job("running"), job("aborted"), job("aborted"), job(None)])
    )
    await p.dispatcher.handle(submission())
    counts = []
    for _ in range(6):
        p.ledger.advance(60.0)
        await p.observe_due()
        counts.append(p.ledger.operations[OP].unknown_status_count)
    assert counts == [1, 2, 0, 1, 2, 3]
    assert p.states()[-2:] == [S.RUNNING, S.STALLED]
    assert p.provider.count("GET") == 6


async def test_a_stalled_reason_names_the_last_answer_without_its_body(pipeline: Callable[..., Pipeline]) -> None:
    """The reason is published on the transitions topic and shown in the live view; the body (which may carry
    outputs or an echoed prompt) stays in the ledger's last answer only."""
    secret_text = "the user's own words"
    p = pipeline(Provider(gets=[job("paused", outputs=[{"id": "o", "text": secret_text}])] * 5))
    await p.dispatcher.handle(submission())
    for _ in range(5):
        p.ledger.advance(60.0)
        await p.observe_due()
    op = p.ledger.operations[OP]
    assert op.state is S.STALLED and op.reason is not None
    assert "http_status=200, body of " in op.reason and secret_text not in op.reason
    assert op.last_observation is not None and secret_text in op.last_observation["body"]


async def test_a_job_observed_past_the_maximum_age_stalls(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline(Provider(gets=[httpx.Response(503)]))
    await p.dispatcher.handle(submission())
    p.ledger.advance(60.0)
    await p.observe_due()
    assert p.ledger.state(OP) is S.SUBMITTED  # a failed GET, young job: polled again
    p.ledger.advance(p.rt.settings.max_observation_age_s)
    await p.observe_due()
    op = p.ledger.operations[OP]
    assert op.state is S.STALLED
    assert op.reason is not None and op.reason.startswith("observed for more than 600 s without becoming terminal")


# --- reconciler (lookup by client reference) -----------------------------------------------------------------


async def _uncertain(p: Pipeline) -> None:
    p.provider.answers["POST"] = [httpx.Response(500, json={"error": {"code": "internal"}})]
    await p.dispatcher.handle(submission())
    assert p.ledger.state(OP) is S.UNCERTAIN


async def test_lookup_waits_for_the_lag_then_adopts_the_oldest_job_found(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline(Provider(lookups=[found("job_a", "job_b")]))
    await _uncertain(p)
    assert await p.reconciler.tick() == 0  # inside the provider's consistency lag
    p.ledger.advance(p.rt.settings.lookup_lag_s)
    assert await p.reconciler.tick() == 1
    op = p.ledger.operations[OP]
    assert (op.state, op.remote_job_id) == (S.SUBMITTED, "job_a")
    assert op.reason is not None and "1 further job(s) recorded as duplicate creations: job_b" in op.reason
    assert p.provider.count("POST") == 1  # never resubmitted


async def test_lookup_that_finds_nothing_leaves_it_uncertain_for_a_person(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline(Provider(lookups=[found()]))
    await _uncertain(p)
    p.ledger.advance(p.rt.settings.lookup_lag_s)
    assert await p.reconciler.tick() == 1
    p.ledger.advance(3600.0)
    assert await p.reconciler.tick() == 0  # gave up: no further lookup
    op = p.ledger.operations[OP]
    assert op.state is S.UNCERTAIN and op.lookup_gave_up_at is not None
    assert op.reason is not None and op.reason.startswith("not found by lookup")
    assert op.reason.endswith("; became uncertain: operation op-1: HTTP 500 without error.job_id; a job may exist")
    assert p.provider.count("LOOKUP") == 1


async def test_a_failed_lookup_is_tried_again_later(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline(Provider(lookups=[httpx.Response(429, headers={"Retry-After": "7"}), found(JOB)]))
    await _uncertain(p)
    p.ledger.advance(p.rt.settings.lookup_lag_s)
    assert await p.reconciler.tick() == 1
    op = p.ledger.operations[OP]
    assert op.state is S.UNCERTAIN
    assert op.next_lookup_at is not None and op.next_lookup_at - op.updated_at == pytest.approx(7.0, abs=1e-6)
    pause_key = budget_key(p.rt.settings, "GET", "pause")  # the 429 paused every worker's GETs for 7 s too
    assert 6000 < await p.rt.leases.client.pttl(pause_key) <= 7000
    p.ledger.advance(7.0)
    await p.rt.leases.client.delete(pause_key)  # the 7 s pass for Redis too
    assert await p.reconciler.tick() == 1
    assert p.ledger.operations[OP].remote_job_id == JOB


# --- relay ---------------------------------------------------------------------------------------------------


async def test_relay_publishes_each_outbox_row_once_and_nothing_when_kafka_fails(
    pipeline: Callable[..., Pipeline],
) -> None:
    p = pipeline(Provider(gets=[succeeded(outputs=1)]))
    await p.dispatcher.handle(submission())
    p.ledger.advance(60.0)
    await p.observe_due()
    p.sent.fail = RuntimeError("broker down")
    assert await p.relay.tick() == 0
    assert all(not r.published for r in p.ledger.outbox)
    p.sent.fail = None
    before = {role: published(role) for role in ("transitions", "outputs_delivered")}
    assert await p.relay.tick() == len(p.ledger.outbox) == 5
    assert await p.relay.tick() == 0
    assert {role: published(role) - n for role, n in before.items()} == {"transitions": 4, "outputs_delivered": 1}
    transitions = [v["event_id"] for v in p.sent.values(p.rt.settings.topic("transitions"))]
    assert transitions == [
        f"transition:{OP}:1:accepted",
        f"transition:{OP}:2:submitting",
        f"transition:{OP}:3:submitted",
        f"transition:{OP}:4:succeeded",
    ]
    [delivered] = p.sent.values(p.rt.settings.topic("outputs_delivered"))
    assert (delivered["event_id"], delivered["output"]["text"]) == (f"output:{OP}:out_0", "text 0")


def published(role: str) -> float:
    """``streams_outbox_published_total`` of ``role`` in this process."""
    return REGISTRY.get_sample_value("streams_outbox_published_total", {"topic_role": role}) or 0.0


# --- the fake's own rules ------------------------------------------------------------------------------------


async def test_the_fake_refuses_an_illegal_transition() -> None:
    ledger = InMemoryLedger()
    await ledger.accept(OP, REQUEST, submitted_at_ms=1)
    with pytest.raises(LedgerDataError, match="illegal transition accepted -> succeeded"):
        ledger._write(ledger.operations[OP], state=S.SUCCEEDED)
    assert ledger.state(OP) is S.ACCEPTED


async def test_a_ledger_outage_is_waited_out(pipeline: Callable[..., Pipeline]) -> None:
    p = pipeline()
    p.ledger.unavailable_calls = 2
    await p.dispatcher.handle(submission())
    assert p.ledger.state(OP) is S.SUBMITTED
    assert p.provider.count("POST") == 1
