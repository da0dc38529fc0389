"""Retention and erasure on the ledger: ``streams purge`` (terminal operations erased in bounded batches, their
transitions, outputs and outbox rows deleted, the row of each id and the accounting kept; with ``--ids-older-than``
the rows of ids purged longer ago deleted too) and ``streams operations
forget`` (one operation's request, source and outputs erased, and the erasure recorded); and the database role an
operator's command runs as (its actor).

Queries of ``queries/retention.sql``; the tables and the grants of ``migrations/0011.retention.sql``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg

from streams.errors import OperatorActionRefusedError, UnknownOperationError
from streams.ledger.pool import guard
from streams.ledger.sql import RETENTION
from streams.model.states import OperationState, is_terminal


@dataclass(frozen=True)
class PurgeCounts:
    """What a purge did (or would do): operations erased (their rows kept) and the transitions, outputs and outbox
    rows deleted with them."""

    operations: int = 0
    transitions: int = 0
    outputs: int = 0
    outbox: int = 0

    def __add__(self, other: PurgeCounts) -> PurgeCounts:
        return PurgeCounts(
            self.operations + other.operations,
            self.transitions + other.transitions,
            self.outputs + other.outputs,
            self.outbox + other.outbox,
        )


@dataclass(frozen=True)
class ForgottenIds:
    """What deleting kept ids did: rows of purged operations deleted (their ids free again), and the callback
    deliveries recorded for them since their purge and their cancellations deleted with them."""

    ids: int = 0
    callback_deliveries: int = 0
    cancellations: int = 0

    def __add__(self, other: ForgottenIds) -> ForgottenIds:
        return ForgottenIds(
            self.ids + other.ids,
            self.callback_deliveries + other.callback_deliveries,
            self.cancellations + other.cancellations,
        )


@dataclass(frozen=True)
class Erasure:
    """One erasure recorded: its id, the operation, the outputs erased, when (the database's clock)."""

    id: int
    operation_id: str
    outputs_erased: int
    at: Any


async def database_role(pool: asyncpg.Pool) -> str:
    """The login role of the pool's sessions (PostgreSQL ``session_user``).

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    async with guard("read the database role"):
        role: str = await RETENTION.database_role.fetchval(pool)
    return role


async def purge_preview(pool: asyncpg.Pool, older_than_s: float) -> dict[str, Any]:
    """What :func:`purge` would do now: ``{operations, held_by_outbox, oldest_age_s, transitions, outputs,
    outbox}`` (``held_by_outbox``: terminal operations old enough but with an unpublished outbox row, kept).

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    return await _preview("preview a purge", RETENTION.purge_preview.fetchrow(pool, older_than_s=older_than_s))


async def purge(
    pool: asyncpg.Pool,
    older_than_s: float,
    batch_size: int,
    *,
    max_batches: int | None = None,
    on_batch: Callable[[PurgeCounts], None] | None = None,
) -> PurgeCounts:
    """Purge the terminal operations (succeeded, failed, canceled, rejected) in their state longer than
    ``older_than_s`` seconds and not purged yet: their transitions, outputs, outbox rows and callback deliveries (not
    counted) deleted, their request (JSON null), source, last observation and reason text erased and ``purged_at``
    set.
    Each operation's row stays, its id taken: a replay of its submission is refused (dead-lettered
    ``conflicting_duplicate``, as after ``forget``), never accepted again and POSTed a second time (migration
    ``0020.purge-keeps-ids``). The accounting rows (remote_calls, remote_jobs, refunds) and the erasure and re-drive
    records stay. One transaction per batch of at most
    ``batch_size`` (>= 1) operations, oldest first, until a batch finds none (or ``max_batches`` ran);
    ``on_batch`` is told each batch's counts. Operations with an unpublished outbox row are kept.

    Raises:
        ValueError: ``batch_size`` < 1 or ``older_than_s`` <= 0.
        LedgerUnavailableError: PostgreSQL did not answer (the batches committed before stay deleted).
    """
    _check_batches(older_than_s, batch_size)
    return await _in_batches(
        lambda: RETENTION.purge_batch.fetchrow(pool, older_than_s=older_than_s, batch_size=batch_size),
        f"purge: a batch of {batch_size}",
        lambda row: PurgeCounts(*(row.get(k, 0) for k in ("operations", "transitions", "outputs", "outbox"))),
        on_batch,
        max_batches,
    )


async def forget_ids_preview(pool: asyncpg.Pool, older_than_s: float) -> dict[str, Any]:
    """What :func:`forget_ids` would delete now: ``{ids, oldest_age_s, callback_deliveries, cancellations}``
    (``oldest_age_s``: since the oldest of them was purged or last replayed; None when none).

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    return await _preview(
        "preview deleting purged ids", RETENTION.forget_ids_preview.fetchrow(pool, older_than_s=older_than_s)
    )


async def _preview(what: str, fetch: Awaitable[Any]) -> dict[str, Any]:
    """The one row of aggregates ``fetch`` (a statement's ``fetchrow``) returns, as a dict."""
    async with guard(what):
        row = await fetch
    assert row is not None  # aggregates only: always one row
    return dict(row)


async def forget_ids(
    pool: asyncpg.Pool,
    older_than_s: float,
    batch_size: int,
    *,
    on_batch: Callable[[ForgottenIds], None] | None = None,
) -> ForgottenIds:
    """Delete the kept rows of the operations purged, and last replayed (a submission of an erased id that came and
    was dead-lettered), more than ``older_than_s`` seconds ago, with the callback deliveries recorded for them since
    and their cancellations: their ids are free again, and a submission with one of them is then accepted as a new
    operation and POSTed. The caller makes sure no replay can come (``streams purge --ids-older-than`` compares the
    horizon with the replaying topics' retention and waits for the workers to consume what was written before).
    Kept: a row with a job created after its decision (the late-job listings, the accounting and ``adopt`` find it by
    operation id). The accounting rows and the records of erasures and re-drives stay. One transaction per batch of
    at most ``batch_size`` (>= 1) rows, oldest first, until a batch finds none; ``on_batch`` is told each batch's
    counts.

    Raises:
        ValueError: ``batch_size`` < 1 or ``older_than_s`` <= 0.
        LedgerUnavailableError: PostgreSQL did not answer (the batches committed before stay deleted).
    """
    _check_batches(older_than_s, batch_size)
    return await _in_batches(
        lambda: RETENTION.forget_ids_batch.fetchrow(pool, older_than_s=older_than_s, batch_size=batch_size),
        f"delete purged ids: a batch of {batch_size}",
        lambda row: ForgottenIds(*(row.get(k, 0) for k in ("ids", "callback_deliveries", "cancellations"))),
        on_batch,
    )


_Counts = TypeVar("_Counts", PurgeCounts, ForgottenIds)


def _check_batches(older_than_s: float, batch_size: int) -> None:
    """Raises ValueError unless ``batch_size`` >= 1 and ``older_than_s`` > 0."""
    if batch_size < 1 or older_than_s <= 0:
        raise ValueError(f"needs a batch size >= 1 and a positive age, got {batch_size} and {older_than_s} s")


async def _in_batches(
    run_batch: Callable[[], Awaitable[Any]],
    what: str,
    counts_of: Callable[[Mapping[str, int]], _Counts],
    on_batch: Callable[[_Counts], None] | None,
    max_batches: int | None = None,
) -> _Counts:
    """Run ``run_batch`` (a statement's ``fetchrow``: one row of counts, read by ``counts_of``, which reads a missing
    count as 0) until a batch changes nothing (its counts all zero) or ``max_batches`` ran; returns the counts' sum,
    each batch's told to ``on_batch``. Raises LedgerUnavailableError when PostgreSQL did not answer (``what``: the
    batch, for its message; the batches committed before stay done)."""
    nothing = total = counts_of({})
    batches = 0
    while max_batches is None or batches < max_batches:
        async with guard(what):
            row = await run_batch()
        assert row is not None
        counts = counts_of(row)
        batches += 1
        if counts == nothing:
            break
        total += counts
        if on_batch is not None:
            on_batch(counts)
    return total


async def forget(pool: asyncpg.Pool, operation_id: str, reason: str, actor: str) -> Erasure:
    """Erase a terminal operation's request body (JSON ``null``), source, last observation and outputs (each
    output's payload and its outbox row's ``output``: JSON ``null``), and record it in ``erasures`` with
    ``reason`` and ``actor``, in one transaction. Its state, transition log and accounting stay.

    Raises:
        UnknownOperationError: the ledger does not hold the operation.
        OperatorActionRefusedError: reason or actor is empty, the operation is not terminal (its request and
            outputs are still in use), one of its outbox rows is not yet published (the relay still needs it), or
            ``streams purge`` erased it already (nothing is left to erase). Nothing is written.
        LedgerUnavailableError: PostgreSQL did not answer (nothing is written).
    """
    action = "forget"
    if not reason.strip() or not actor.strip():
        raise OperatorActionRefusedError(operation_id, action, "a reason and an actor are required")
    async with guard(f"forget {operation_id}"), pool.acquire() as conn, conn.transaction():
        row = await RETENTION.lock_for_erasure.fetchrow(conn, operation_id=operation_id)
        if row is None:
            raise UnknownOperationError(operation_id)
        state = OperationState(row["state"])
        if not is_terminal(state):
            raise OperatorActionRefusedError(
                operation_id,
                action,
                f"the operation is {state.value}, not terminal: its request and outputs are still in use; decide it "
                "first (streams operations abandon|fail) or wait until it finishes",
                state=state.value,
            )
        if row["purged_at"] is not None:
            raise OperatorActionRefusedError(
                operation_id,
                action,
                f"streams purge erased it at {row['purged_at'].isoformat()}: its request, source and outputs are "
                "gone already; nothing to erase",
                state=state.value,
            )
        if row["unpublished"]:
            raise OperatorActionRefusedError(
                operation_id,
                action,
                f"{row['unpublished']} of its outbox rows are not yet published: wait for the relay, then forget it",
                state=state.value,
            )
        await RETENTION.erase_operation.execute(conn, operation_id=operation_id, actor=actor)
        erased = await RETENTION.erase_outputs.fetchrow(conn, operation_id=operation_id)
        assert erased is not None
        record = await RETENTION.record_erasure.fetchrow(
            conn, operation_id=operation_id, reason=reason, actor=actor, outputs_erased=erased["outputs"]
        )
        assert record is not None
    return Erasure(record["id"], operation_id, erased["outputs"], record["at"])


async def erasures_of(pool: asyncpg.Pool, operation_id: str) -> list[dict[str, Any]]:
    """The erasures recorded for ``operation_id``, oldest first: ``[{id, reason, actor, outputs_erased, at}]``.

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    async with guard(f"read the erasures of {operation_id}"):
        return [dict(r) for r in await RETENTION.erasures_of.fetch(pool, operation_id=operation_id)]
