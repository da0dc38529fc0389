"""Which first polls a worker takes itself (streams/worker/stages/firstpoll.py, FirstPolls.reserve): a hint within
``first_poll_in_process_max_s``, room under ``observer_concurrency``, GETs not paced, not closed."""

from __future__ import annotations

import asyncio
import time
import types
from typing import Any

from streams import metrics
from streams.config import Settings
from streams.coordination.ratebudget import BudgetKind, Pace
from streams.ledger.records import FirstPollClaim, ObserveClaim
from streams.model.states import OperationState
from streams.worker.stages.firstpoll import FirstPolls


def first_polls(*, get_rate_per_s: float = 0.0, **changes: Any) -> FirstPolls:
    s = Settings(**changes)
    rt: Any = types.SimpleNamespace(
        settings=s, budget=types.SimpleNamespace(paces={BudgetKind.CLAIMS: Pace.from_rate(get_rate_per_s, 1)})
    )
    return FirstPolls(rt, observer=None, slots=asyncio.Semaphore(1))  # type: ignore[arg-type]  # reserve only


def test_a_hint_within_the_setting_is_taken_and_a_longer_one_is_not() -> None:
    polls = first_polls(first_poll_in_process_max_s=1.0)
    assert polls.reserve(0.05) and polls.reserve(1.0)
    assert not polls.reserve(1.01)


def test_the_setting_at_zero_takes_none() -> None:
    assert not first_polls(first_poll_in_process_max_s=0.0).reserve(0.0)


def test_at_most_observer_concurrency_are_held_and_a_reservation_given_back_makes_room() -> None:
    polls = first_polls(observer_concurrency=2)
    assert [polls.reserve(0.05) for _ in range(3)] == [True, True, False]
    polls.unreserve()
    assert polls.reserve(0.05)


def test_paced_gets_leave_every_first_poll_to_the_scheduler() -> None:
    assert not first_polls(get_rate_per_s=10.0).reserve(0.05)
    assert first_polls(get_rate_per_s=0.0).reserve(0.05)


def test_completion_callbacks_leave_every_first_poll_to_the_scheduler() -> None:
    assert not first_polls(callbacks_enabled=True, callback_secrets="whsec_dGVzdHNlY3JldHRlc3RzZWNyZXQ=").reserve(0.05)


CLAIM = FirstPollClaim(7, ObserveClaim(2, "job-1", OperationState.SUBMITTED, 0))


async def test_a_save_ending_after_close_starts_nothing_and_gives_its_reservation_back() -> None:
    polls = first_polls()
    assert polls.reserve(0.05)
    await polls.close()
    polls.start("op-1", CLAIM, time.monotonic())
    assert polls.held == 0
    assert not polls.reserve(0.05)


class Failing:
    async def observe_first_poll(self, operation_id: str, first: FirstPollClaim) -> None:
        raise RuntimeError("boom")


def recording_reschedules(polls: FirstPolls) -> list[tuple[str, int, float]]:
    """Give ``polls``' runtime a ledger whose ``reschedule_poll`` records its calls (operation, poll claim, delay)."""
    rescheduled: list[tuple[str, int, float]] = []

    async def reschedule_poll(operation_id: str, poll_claim_id: int, delay_s: float) -> bool:
        rescheduled.append((operation_id, poll_claim_id, delay_s))
        return True

    rt: Any = polls.rt
    rt.ledger = types.SimpleNamespace(reschedule_poll=reschedule_poll)
    return rescheduled


async def test_an_error_out_of_the_observation_is_reported_and_the_poll_made_due_at_once() -> None:
    reported: list[str] = []
    polls = first_polls()
    rescheduled = recording_reschedules(polls)
    rt: Any = polls.rt
    rt.report_failure = lambda where, exc: reported.append(f"{where}: {exc}")
    polls.observer = Failing()  # type: ignore[assignment]
    failed, given_back = (
        metrics.FIRST_POLLS.labels("failed")._value.get(),
        metrics.FIRST_POLLS.labels("given_back")._value.get(),
    )
    assert polls.reserve(0.0)
    polls.start("op-1", CLAIM, time.monotonic())
    while polls.held:
        await asyncio.sleep(0)
    assert reported == ["first_poll: boom"]
    assert rescheduled == [("op-1", 7, 0.0)]
    assert metrics.FIRST_POLLS.labels("failed")._value.get() == failed + 1
    assert metrics.FIRST_POLLS.labels("given_back")._value.get() == given_back + 1


async def test_close_in_the_turn_of_a_start_gives_the_poll_back_and_its_reservation() -> None:
    polls = first_polls()
    rescheduled = recording_reschedules(polls)
    assert polls.reserve(0.05)
    polls.start("op-1", CLAIM, time.monotonic() + 0.05)  # its task has not run a step when close() cancels it
    await polls.close()
    assert rescheduled == [("op-1", 7, 0.0)]
    assert polls.held == 0
