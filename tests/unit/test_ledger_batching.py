"""The ledger's batching rules, on statements stubbed in Python: how a batch is split into statements, a batch
refused for one request's values, an outage in the middle, and statements PostgreSQL rolls back (deadlock).
The same rules against the real PostgreSQL: tests/integration/test_ledger_batches.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import asyncpg
import pytest
from prometheus_client import REGISTRY

from streams.errors import LedgerDataError, LedgerUnavailableError
from streams.ledger import batching as ledger_module
from streams.ledger.batching import RUN_ALONE, WAIT_FOR_LOCKS, Batcher, Request, _rounds


def test_rounds_put_each_operation_once_per_statement_in_the_order_requests_were_made() -> None:
    requests = [("b", 1), ("a", 1), ("b", 2), ("c", 1), ("b", 3), ("a", 2)]
    assert _rounds(requests, distinct=True) == [[1, 0, 3], [5, 2], [4]]  # positions, sorted by operation id
    assert _rounds(requests, distinct=False) == [[1, 5, 0, 2, 4, 3]]
    assert _rounds([], distinct=True) == []


class Statements:
    """A stub statement: records each call's operation ids; ``bad`` ids make a batch holding them fail as
    PostgreSQL would refuse a value; ``held`` ids are locked by another transaction (a statement with a lock
    timeout holding one gives up; without, it waits until ``released``); ``down_after`` calls, it raises an
    outage; ``rollbacks`` calls raise DeadlockDetectedError first."""

    def __init__(
        self, bad: Iterable[str] = (), held: Iterable[str] = (), down_after: int | None = None, rollbacks: int = 0
    ) -> None:
        self.calls: list[list[str]] = []
        self.lock_timeouts: list[str] = []
        self.bad = set(bad)
        self.held = set(held)
        self.released = asyncio.Event()
        self.down_after = down_after
        self.rollbacks = rollbacks

    async def __call__(self, batch: list[Request], lock_timeout: str) -> list[Any]:
        self.calls.append([r[0] for r in batch])
        self.lock_timeouts.append(lock_timeout)
        if self.held & {r[0] for r in batch}:
            if lock_timeout != WAIT_FOR_LOCKS:
                raise asyncpg.LockNotAvailableError("canceling statement due to lock timeout")
            await self.released.wait()
        if self.down_after is not None and len(self.calls) > self.down_after:
            raise ConnectionRefusedError("connection refused")  # an outage, as _guard classifies it
        if self.rollbacks:
            self.rollbacks -= 1
            raise asyncpg.DeadlockDetectedError("deadlock detected")
        if self.bad & {r[0] for r in batch}:
            raise asyncpg.UntranslatableCharacterError("unsupported Unicode escape sequence")
        return [f"{r[0]}#{r[1]}" for r in batch]


def ledger() -> Batcher:
    return Batcher()


async def test_a_batch_refused_for_one_request_is_run_one_by_one_and_only_that_request_fails() -> None:
    stmt = Statements(bad={"b"})
    labels = {"stage": "t1", "reason": "refused_value"}
    before = REGISTRY.get_sample_value("streams_ledger_batch_fallbacks_total", labels) or 0.0
    results = await ledger()._flush("t1", stmt, True, [("c", 1), ("b", 1), ("a", 1)], "100ms")
    assert results[0] == "c#1" and results[2] == "a#1"
    assert isinstance(results[1], LedgerDataError) and "UntranslatableCharacterError" in str(results[1])
    assert stmt.calls == [["a", "b", "c"], ["a"], ["b"], ["c"]]
    assert REGISTRY.get_sample_value("streams_ledger_batch_fallbacks_total", labels) == before + 1


async def test_an_outage_fails_the_statement_it_hit_and_the_later_ones_not_the_earlier_ones() -> None:
    stmt = Statements(down_after=1)
    results = await ledger()._flush("t2", stmt, True, [("a", 1), ("a", 2), ("b", 1), ("a", 3)], "100ms")
    assert results[0] == "a#1" and results[2] == "b#1"  # the first statement was written: its results stand
    assert all(isinstance(r, LedgerUnavailableError) for r in (results[1], results[3]))
    assert stmt.calls == [["a", "b"], ["a"]]  # the third statement is not sent while PostgreSQL is down


async def test_a_statement_rolled_back_as_a_deadlock_victim_runs_again_and_callers_see_nothing() -> None:
    stmt = Statements(rollbacks=2)
    labels = {"stage": "t3", "sqlstate": "40P01"}
    before = REGISTRY.get_sample_value("streams_ledger_conflicts_total", labels) or 0.0
    assert await ledger()._flush("t3", stmt, True, [("a", 1), ("b", 1)], "100ms") == ["a#1", "b#1"]
    assert stmt.calls == [["a", "b"]] * 3
    assert REGISTRY.get_sample_value("streams_ledger_conflicts_total", labels) == before + 2


async def test_a_statement_that_keeps_being_rolled_back_becomes_unavailable_which_callers_wait_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ledger_module, "CONFLICT_ATTEMPTS", 3)
    stmt = Statements(rollbacks=3)
    results = await ledger()._flush("t4", stmt, True, [("a", 1)], "100ms")
    assert isinstance(results[0], LedgerUnavailableError) and "rolled back 3 times" in str(results[0])
    assert len(stmt.calls) == 3


async def test_concurrent_callers_share_a_statement_and_get_their_own_results() -> None:
    led = ledger()
    stmt = Statements(bad={"x"})
    led.stage("t5", stmt)
    results = await asyncio.gather(
        *(led.submit("t5", (op, n)) for op, n in [("b", 1), ("x", 1), ("a", 1), ("b", 2)]), return_exceptions=True
    )
    assert results[0] == "b#1" and results[2] == "a#1" and results[3] == "b#2"
    assert isinstance(results[1], LedgerDataError)
    # one batch: first statement a, b, x (refused, then one by one), second statement the repeat of b
    assert stmt.calls == [["a", "b", "x"], ["a"], ["b"], ["x"], ["b"]]


async def test_a_batch_that_waits_too_long_for_a_lock_lets_each_request_run_alone() -> None:
    """One request's row is locked elsewhere: its batch gives up, every caller runs its request alone; the others
    finish at once and the next batches of the kind go out, while the held one waits for its lock alone."""
    led = ledger()
    stmt = Statements(held={"h"})
    led.stage("t6", stmt)
    labels = {"stage": "t6", "reason": "lock_wait"}
    before = REGISTRY.get_sample_value("streams_ledger_batch_fallbacks_total", labels) or 0.0
    held = asyncio.ensure_future(led.submit("t6", ("h", 1)))
    first = await asyncio.gather(led.submit("t6", ("a", 1)), led.submit("t6", ("b", 1)))
    assert list(first) == ["a#1", "b#1"]  # gather's list, typed as a tuple
    assert await led.submit("t6", ("c", 1)) == "c#1"  # a later batch of the same kind is not held up
    assert not held.done()
    stmt.released.set()
    assert await held == "h#1"
    assert stmt.calls[0] == ["a", "b", "h"] and stmt.lock_timeouts[0] == "100ms"
    assert sorted(stmt.calls[1:4]) == [["a"], ["b"], ["h"]] and set(stmt.lock_timeouts[1:4]) == {WAIT_FOR_LOCKS}
    assert REGISTRY.get_sample_value("streams_ledger_batch_fallbacks_total", labels) == before + 1
    results = await ledger()._flush("t6", Statements(held={"h"}), True, [("h", 1), ("h", 2), ("a", 1)], "100ms")
    assert results == [RUN_ALONE] * 3


async def test_without_batching_each_call_is_its_own_statement_and_raises_its_own_error() -> None:
    led = Batcher(batching=False)
    stmt = Statements(bad={"x"})
    led.stage("t7", stmt)
    assert await led.submit("t7", ("a", 1)) == "a#1"
    with pytest.raises(LedgerDataError):
        await led.submit("t7", ("x", 1))
    assert stmt.calls == [["a"], ["x"]] and stmt.lock_timeouts == [WAIT_FOR_LOCKS] * 2
