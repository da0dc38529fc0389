"""Downstream duplicate suppression by event id."""

from __future__ import annotations

from streams.clients.follow import EventDeduplicator


def test_first_time_once_then_duplicates_counted() -> None:
    d = EventDeduplicator()
    assert d.first_time("output:op-1:out-0") is True
    assert d.first_time("output:op-1:out-0") is False
    assert d.first_time("output:op-1:out-0") is False
    assert d.first_time("output:op-1:out-1") is True
    assert d.first_time("output:op-2:out-0") is True
    assert d.duplicates == 2


def test_fresh_deduplicator_has_no_duplicates() -> None:
    d = EventDeduplicator()
    assert d.duplicates == 0
    assert d.capacity == 1_000_000


def test_replayed_stream_yields_each_id_once() -> None:
    d = EventDeduplicator(capacity=100)
    stream = ["a", "b", "a", "c", "b", "a", "d", "c"]
    assert [e for e in stream if d.first_time(e)] == ["a", "b", "c", "d"]
    assert d.duplicates == 4


def test_capacity_evicts_the_oldest() -> None:
    d = EventDeduplicator(capacity=2)
    assert [d.first_time(e) for e in ("a", "b", "c")] == [True, True, True]
    # "a" was the oldest and fell out of the window; "b" and "c" are still remembered.
    assert d.first_time("c") is False
    assert d.first_time("b") is False
    assert d.duplicates == 2
    assert d.first_time("a") is True  # forgotten, so seen as new (and now "b" is evicted)
    assert d.first_time("b") is True
    assert d.duplicates == 2


def test_capacity_one() -> None:
    d = EventDeduplicator(capacity=1)
    assert d.first_time("x") is True
    assert d.first_time("x") is False
    assert d.first_time("y") is True
    assert d.first_time("x") is True
    assert d.duplicates == 1


def test_window_holds_exactly_capacity_ids() -> None:
    d = EventDeduplicator(capacity=1000)
    ids = [f"e{i}" for i in range(1500)]
    assert all(d.first_time(e) for e in ids)
    # The last 1000 are remembered, the first 500 are not.
    assert [d.first_time(e) for e in ids[500:]] == [False] * 1000
    assert d.duplicates == 1000
    assert d.first_time("e499") is True
