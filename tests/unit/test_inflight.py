"""In-order acknowledgement bookkeeping (pure logic)."""

from __future__ import annotations

import random

import pytest

from streams.worker.inflight import InOrderAcks


def test_an_event_finished_early_waits_for_the_ones_before_it() -> None:
    acks: InOrderAcks[int] = InOrderAcks()
    t = [acks.track("p0", offset) for offset in range(5)]
    assert acks.finish(t[0]) == [0]
    assert acks.finish(t[1]) == [1]
    assert acks.finish(t[3]) == []  # 2 still in flight: 3 and 4 wait
    assert acks.finish(t[4]) == []
    assert acks.in_flight() == 3
    assert acks.finish(t[2]) == [2, 3, 4]
    assert acks.in_flight() == 0


def test_partitions_are_independent() -> None:
    acks: InOrderAcks[tuple[str, int]] = InOrderAcks()
    a0 = acks.track("a", ("a", 0))
    b0 = acks.track("b", ("b", 0))
    b1 = acks.track("b", ("b", 1))
    assert acks.finish(b1) == []
    assert acks.finish(b0) == [("b", 0), ("b", 1)]  # partition a's unfinished event does not hold b
    assert acks.in_flight() == 1
    assert acks.finish(a0) == [("a", 0)]


def test_finishing_twice_or_untracked_is_refused() -> None:
    acks: InOrderAcks[int] = InOrderAcks()
    t = acks.track("p", 1)
    assert acks.finish(t) == [1]
    with pytest.raises(ValueError, match="finished twice"):
        acks.finish(t)
    other: InOrderAcks[int] = InOrderAcks()
    with pytest.raises(ValueError, match="not tracked"):
        other.finish(InOrderAcks[int]().track("q", 2))


@pytest.mark.parametrize("seed", range(20))
def test_released_offsets_are_always_a_prefix_in_order(seed: int) -> None:
    """Whatever order handling ends in, the released offsets of a partition are exactly the longest run of
    finished offsets from the start: never one past an unfinished offset."""
    rng = random.Random(seed)
    acks: InOrderAcks[int] = InOrderAcks()
    tickets = [acks.track("p", offset) for offset in range(200)]
    order = list(range(200))
    rng.shuffle(order)
    finished: set[int] = set()
    released: list[int] = []
    for i in order:
        finished.add(i)
        released += acks.finish(tickets[i])
        prefix = 0
        while prefix in finished:
            prefix += 1
        assert released == list(range(prefix))
    assert released == list(range(200))
