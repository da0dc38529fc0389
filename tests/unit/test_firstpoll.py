"""Which first polls a worker takes itself (streams/worker/stages/firstpoll.py, FirstPolls.reserve): a hint within
``first_poll_in_process_max_s``, room under ``observer_concurrency``, GETs not paced, not closed."""

from __future__ import annotations

import asyncio
import types
from typing import Any

from streams.config import Settings
from streams.coordination.ratebudget import BudgetKind, Pace
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
