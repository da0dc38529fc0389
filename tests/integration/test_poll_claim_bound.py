"""The scheduler's back-pressure on poll claims, on the real PostgreSQL: the polls claimed and not yet taken by an
observer stay within the bound (its least value, then the observers' pace), whatever worker claims; a taken poll
makes room; an expired claim is claimed again (a poll lost with a dead worker comes back); oldest due first."""

from __future__ import annotations

import asyncpg
import pytest

from streams.ledger.records import ClaimBound
from streams.ledger.store import Ledger
from tests.support import wait_for

pytestmark = pytest.mark.integration

REQUEST = '{"input": {"prompt": "p", "max_tokens": 2}}'


async def due(ledger: Ledger, ops: list[str]) -> None:
    """``ops`` submitted with jobs ``<op>-job``, due now, the first one first (oldest due first)."""
    for op in ops:
        assert await ledger.accept(op, REQUEST, submitted_at_ms=1)
        fencing = await ledger.claim_for_submit(op)
        assert fencing is not None
        assert await ledger.save_submitted(op, fencing, f"{op}-job", 0.0, None)


async def test_claims_stay_within_the_bound_and_follow_what_observers_take(ledger: Ledger) -> None:
    ops = [f"cb-{i:02d}" for i in range(10)]
    await due(ledger, ops)
    # least 3; the pace read over 60 s is scaled to 60 s: the bound is the polls taken in the last minute.
    bound = ClaimBound(least=3, pace_window_s=60.0, take_target_s=60.0)
    first = await ledger.claim_due_polls(100, 3600.0, bound)
    assert [p.operation_id for p in first] == ops[:3]  # oldest due first, no more than the least bound
    assert await ledger.claim_due_polls(100, 3600.0, bound) == []  # another worker's round: nothing more
    # An observer takes two: the observers took 2 in the window (bound still 3), 1 claimed and not yet taken.
    for p in first[:2]:
        assert await ledger.claim_for_observe(p.operation_id, p.poll_claim_id) is not None
    second = await ledger.claim_due_polls(100, 3600.0, bound)
    assert [p.operation_id for p in second] == ops[3:5]
    # A poll rescheduled without an observe claim (lease busy) is taken too: it makes room as well.
    assert await ledger.reschedule_poll(second[0].operation_id, second[0].poll_claim_id, 3600.0)
    third = await ledger.claim_due_polls(100, 3600.0, bound)
    assert [p.operation_id for p in third] == [ops[5]]
    # The other 3 taken (6 in the window): the bound follows the pace up to 6, none not yet taken: room for 6, 4 due.
    for p in [first[2], second[1], third[0]]:
        assert await ledger.claim_for_observe(p.operation_id, p.poll_claim_id) is not None
    assert [p.operation_id for p in await ledger.claim_due_polls(100, 3600.0, bound)] == ops[6:]
    assert await ledger.claim_due_polls(100, 3600.0, None) == []  # nothing due left


async def test_the_pace_is_scaled_to_the_take_target(ledger: Ledger) -> None:
    ops = [f"cs-{i:02d}" for i in range(20)]
    await due(ledger, ops)
    unbounded = await ledger.claim_due_polls(4, 3600.0, None)
    for p in unbounded:
        assert await ledger.claim_for_observe(p.operation_id, p.poll_claim_id) is not None
    # 4 taken in the window of 60 s, to be taken within 30 s: a bound of 2; least 1.
    half = ClaimBound(least=1, pace_window_s=60.0, take_target_s=30.0)
    assert [p.operation_id for p in await ledger.claim_due_polls(100, 3600.0, half)] == ops[4:6]


async def test_an_expired_claim_is_claimed_again_and_no_longer_counts(ledger: Ledger, pool: asyncpg.Pool) -> None:
    await due(ledger, ["ce-0"])
    bound = ClaimBound(least=1, pace_window_s=60.0, take_target_s=60.0)
    (lost,) = await ledger.claim_due_polls(100, 1.0, bound)  # its event is lost with a dead worker
    assert lost.operation_id == "ce-0"
    assert await ledger.claim_due_polls(100, 1.0, bound) == []  # not due, and the bound is used
    again: list[str] = []

    async def claimed_again() -> bool:
        again.extend(p.operation_id for p in await ledger.claim_due_polls(100, 1.0, bound))
        return bool(again)

    await wait_for(claimed_again, 10, "the lost poll claimed again after its visibility timeout")
    assert again == ["ce-0"]  # it comes back: its expired claim no longer counts against the bound
    row = await pool.fetchrow(
        "SELECT poll_claim_id, poll_claimed_at IS NOT NULL AS claimed FROM operations WHERE operation_id = 'ce-0'"
    )
    assert (row["poll_claim_id"], row["claimed"]) == (lost.poll_claim_id + 1, True)


async def poll_due_in_s(ledger: Ledger) -> float | None:
    """The scheduler's idle reading of the next poll due (s), stale ages far enough not to matter here."""
    return (await ledger.next_due_in_s(3600.0, 3600.0)).poll_due_in_s


async def test_the_claim_reads_the_next_poll_due_as_next_due_in_s_would_after_it(ledger: Ledger) -> None:
    assert await ledger.claim_due_polls_and_next(10, 3600.0, None) == ([], await poll_due_in_s(ledger))
    ops = [f"cn-{i:02d}" for i in range(3)]
    await due(ledger, ops)
    # two of three claimed: the third is still due (negative), the two claimed come back in an hour
    polls, due_in_s = await ledger.claim_due_polls_and_next(2, 3600.0, None)
    assert [p.operation_id for p in polls] == ops[:2]
    after = await poll_due_in_s(ledger)
    assert due_in_s is not None and after is not None
    assert due_in_s <= 0 and abs(due_in_s - after) < 5.0
    # the last one claimed: the earliest poll due is a claimed one's, an hour out (the visibility timeout)
    polls, due_in_s = await ledger.claim_due_polls_and_next(2, 3600.0, None)
    assert [p.operation_id for p in polls] == ops[2:]
    after = await poll_due_in_s(ledger)
    assert due_in_s is not None and after is not None
    assert 3590.0 < due_in_s <= 3600.0 and abs(due_in_s - after) < 5.0
    # nothing due: no claim, the same reading
    polls, due_in_s = await ledger.claim_due_polls_and_next(2, 3600.0, None)
    assert polls == [] and due_in_s is not None and 3590.0 < due_in_s <= 3600.0
