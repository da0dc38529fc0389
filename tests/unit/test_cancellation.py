"""Cancellation over the in-memory ledger (:mod:`tests.fakes`) with the real stages and the real client answered by
a scripted provider: each state an operation may be canceled in, and the provider's cancel answers
(docs/cancellation.md). The same paths against PostgreSQL and the simulator: tests/integration/test_cancellation.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import orjson
import pytest

from streams.config import Settings
from streams.ledger.records import CancelPath
from streams.model.codes import ReasonCode, RemoteCallOutcome
from streams.model.states import OperationState
from streams.remote.client import classify_cancel_answer
from streams.worker.runtime import RawMessage
from streams.worker.stages.canceller import Canceller
from tests.unit.test_pipeline import JOB, OP, Answer, Pipeline, Provider, job, settings, submission, succeeded

S = OperationState
__all__ = ["settings"]  # the pipeline tests' settings fixture, used here
C = RemoteCallOutcome


class CancelingProvider(Provider):
    """The scripted provider plus a cancel route: each cancel takes the next answer of ``cancels``."""

    def __init__(self, cancels: list[Answer], gets: list[Answer] | None = None) -> None:
        super().__init__(gets=gets)
        self.answers["CANCEL"] = cancels

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/cancel"):
            self.requests.append(request)
            queue = self.answers["CANCEL"]
            answer = queue.pop(0) if len(queue) > 1 else queue[0]
            if isinstance(answer, Exception):
                raise answer
            return answer
        return await super().__call__(request)

    def cancels(self) -> int:
        return sum(1 for r in self.requests if r.url.path.endswith("/cancel"))


def cancellation(op: str = OP, reason: str = "user left", key: str | None = None) -> RawMessage:
    value = orjson.dumps(
        {"operation_id": op, "reason": reason, "requested_by": "app-1", "requested_at_ms": int(time.time() * 1000)}
    )
    return RawMessage("generation.cancellations", 0, 3, (key or op).encode(), value)


@pytest.fixture
def make(settings: Settings) -> Callable[..., Pipeline]:
    def build(provider: Provider) -> Pipeline:
        return Pipeline(settings.replace(cancel_attempt_limit=3), provider)

    return build


@pytest.mark.parametrize(
    ("status", "outcome", "definite"),
    [
        (200, C.CANCEL_ACCEPTED, True),
        (202, C.CANCEL_ACCEPTED, True),
        (409, C.CANCEL_ALREADY_TERMINAL, True),
        (400, C.CANCEL_REFUSED, True),
        (404, C.CANCEL_NOT_FOUND, False),
        (429, C.CANCEL_UNKNOWN_OUTCOME, False),
        (500, C.CANCEL_UNKNOWN_OUTCOME, False),
        (503, C.CANCEL_UNKNOWN_OUTCOME, False),
    ],
)
def test_the_cancel_routes_answers_are_classified(status: int, outcome: RemoteCallOutcome, definite: bool) -> None:
    assert classify_cancel_answer(status) == (outcome, definite)


async def test_canceled_before_the_post_sends_no_post(make: Callable[..., Pipeline]) -> None:
    p = make(CancelingProvider([httpx.Response(200)]))
    await p.rt.ledger.accept(OP, '{"input": {}}', submitted_at_ms=1)
    await Canceller(p.rt).handle(cancellation())
    assert p.ledger.state(OP) is S.CANCELED
    await p.dispatcher.handle(submission())  # the submission's event handled after the cancel
    assert p.provider.count("POST") == 0 and p.states() == [S.ACCEPTED, S.CANCELED]
    assert p.ledger.operations[OP].reason_code is ReasonCode.CANCELED_BEFORE_SUBMIT
    assert p.ledger.cancellations[OP].path is CancelPath.TOPIC and p.ledger.cancellations[OP].actor == "app-1"


async def test_a_cancel_that_overtakes_its_submission_ends_it_canceled_at_the_claim(
    make: Callable[..., Pipeline],
) -> None:
    p = make(CancelingProvider([httpx.Response(200)]))
    await Canceller(p.rt).handle(cancellation())  # not in the ledger yet: recorded only
    assert p.ledger.cancellations[OP].state_when_asked is None
    await p.dispatcher.handle(submission())
    assert p.provider.count("POST") == 0
    assert p.states() == [S.ACCEPTED, S.CANCELED]


async def test_a_running_job_is_canceled_at_the_provider_once_and_ends_canceled(
    make: Callable[..., Pipeline],
) -> None:
    provider = CancelingProvider([httpx.Response(200, json={"id": JOB, "status": "canceled"})], gets=[job("running")])
    p = make(provider)
    await p.dispatcher.handle(submission())
    await p.observe_due()
    await Canceller(p.rt).handle(cancellation())
    await Canceller(p.rt).handle(cancellation())  # a replay: recorded once
    provider.answers["GET"] = [job("canceled")]
    p.ledger.advance(60)
    await p.observe_due()
    assert provider.cancels() == 1
    assert p.states() == [S.ACCEPTED, S.SUBMITTING, S.SUBMITTED, S.RUNNING, S.CANCELED]
    assert [c.outcome for c in p.ledger.remote_calls if c.method == "CANCEL"] == [C.CANCEL_ACCEPTED]
    assert not [r for r in p.ledger.outbox if r.topic_role == "outputs_delivered"]
    p.ledger.advance(60)
    await p.observe_due()  # terminal: no poll, no second cancel
    assert provider.cancels() == 1


async def test_a_job_that_succeeded_first_stays_succeeded_with_its_outputs(make: Callable[..., Pipeline]) -> None:
    provider = CancelingProvider([httpx.Response(409, json={"error": {"code": "already_terminal"}})])
    p = make(provider)
    await p.dispatcher.handle(submission())
    await Canceller(p.rt).handle(cancellation())  # asked while submitted
    provider.answers["GET"] = [succeeded(outputs=2)]
    p.ledger.advance(60)
    await p.observe_due()
    assert provider.cancels() == 1
    assert p.states()[-1] is S.SUCCEEDED
    assert p.ledger.operations[OP].cancel_outcome is C.CANCEL_ALREADY_TERMINAL
    assert len([r for r in p.ledger.outbox if r.topic_role == "outputs_delivered"]) == 2


async def test_an_unknown_cancel_answer_is_asked_again_at_each_poll_up_to_the_limit(
    make: Callable[..., Pipeline],
) -> None:
    provider = CancelingProvider([httpx.Response(503)], gets=[job("running")])
    p = make(provider)  # cancel_attempt_limit=3
    await p.dispatcher.handle(submission())
    await Canceller(p.rt).handle(cancellation())
    for _ in range(5):
        p.ledger.advance(60)
        await p.observe_due()
    assert provider.cancels() == 3
    assert [c.outcome for c in p.ledger.remote_calls if c.method == "CANCEL"] == [C.CANCEL_UNKNOWN_OUTCOME] * 3
    assert p.ledger.operations[OP].cancel_attempts == 3 and p.ledger.state(OP) is S.RUNNING


async def test_an_uncertain_operation_records_the_cancel_and_a_terminal_one_keeps_its_state(
    make: Callable[..., Pipeline],
) -> None:
    provider = CancelingProvider([httpx.Response(200)])
    provider.answers["POST"] = [httpx.Response(500)]
    p = make(provider)
    await p.dispatcher.handle(submission())
    assert p.ledger.state(OP) is S.UNCERTAIN
    await Canceller(p.rt).handle(cancellation())
    assert p.ledger.state(OP) is S.UNCERTAIN and OP in p.ledger.cancellations and provider.cancels() == 0
    await p.dispatcher.handle(submission("op-2"))
    assert p.ledger.state("op-2") is S.UNCERTAIN


async def test_a_cancellation_keyed_by_another_id_is_dead_lettered(make: Callable[..., Pipeline]) -> None:
    p = make(CancelingProvider([httpx.Response(200)]))
    await Canceller(p.rt).handle(cancellation(key="other"))
    assert OP not in p.ledger.cancellations
    assert [t for t, _, _ in p.sent.records] == [p.rt.settings.topic("dead_letter")]
