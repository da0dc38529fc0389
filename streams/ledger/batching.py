"""The batching engine of the ledger's hot-path statements (group commit over :mod:`streams.coalesce`).

Batching (group commit, :mod:`streams.coalesce`; docs/guarantees.md): the statements every
operation makes on the hot path (accept, the dispatcher's claim and job-id save, the observer's claim, save and
reschedule, the accounting of remote calls) are coalesced across this worker's concurrent tasks: the requests made
while the previous batch of the same kind is on the wire go out as one statement over parallel arrays
(``streams/ledger/queries/ledger.sql``). Each caller still gets exactly the result its own statement would have given:

* an operation appears at most once per statement; a second request for it (two tasks handling one
  operation) goes in a later statement, in the order the requests were made;
* the rows are locked in ``operation_id`` order before they are changed, so two batches (two workers) never
  wait on each other in a cycle; a deadlock or serialization failure all the same (a statement of another
  kind) rolls the statement back, which is then run again (:data:`CONFLICT_ATTEMPTS`; counted in
  ``streams_ledger_conflicts_total``): nothing is written twice, nothing is lost, nothing is raised to the
  caller unless it keeps failing (then :class:`LedgerUnavailableError`, which callers wait out);
* a batch PostgreSQL refuses for one request's values (:class:`LedgerDataError`, e.g. a NUL in an output) is
  run again one statement per request, so only that request fails (``streams_ledger_batch_fallbacks_total``);
* a batch waits at most :data:`BATCH_LOCK_TIMEOUT` for a lock another transaction holds (an operator's
  command, a test holding a row): past it, nothing is written and each of its callers runs its request alone,
  waiting as long as it takes, so one held row never holds up the other operations (nor this kind's next
  batches);
* PostgreSQL unavailable fails the requests of that statement (and of its later statements) with
  :class:`LedgerUnavailableError`; the callers wait it out and send them again.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from streams import metrics
from streams.coalesce import LINGER_UNDER_LOAD_S, Coalescer
from streams.errors import LedgerDataError, LedgerUnavailableError, error_summary
from streams.ledger.pool import guard
from streams.ledger.sql import Query

log = logging.getLogger(__name__)

#: Most requests in one batched statement.
BATCH_MAX = 256

#: Batched statements of one kind on the wire at once per worker; the requests made meanwhile form the next one.
#: One: fewer, larger batches (less CPU and fewer round trips per operation than two, by ``streams bench``:
#: CHANGELOG.md), and seven kinds then need at most seven pooled connections.
BATCH_IN_FLIGHT = 1

#: Attempts at one statement that PostgreSQL rolled back as a deadlock victim or a serialization failure
#: (SQLSTATE class 40: nothing was written; running it again is safe). Past them: LedgerUnavailableError.
CONFLICT_ATTEMPTS = 8

#: How long a batched statement waits for a lock held by another transaction (PostgreSQL ``lock_timeout``, set
#: for that statement only) before its requests are run one by one, each waiting as long as it takes (``"0"``).
BATCH_LOCK_TIMEOUT = "100ms"
WAIT_FOR_LOCKS = "0"

#: One request of a batched statement: its parameters, the operation id first.
Request = tuple[Any, ...]

#: Runs one batched statement for distinct operations: (requests, lock_timeout) -> one result per request, in the
#: same order.
Statement = Callable[[list[Request], str], Awaitable[list[Any]]]


class _RunAlone:
    """A batch's answer to a request whose statement waited too long for a lock: its caller runs it alone."""


RUN_ALONE = _RunAlone()


def _rounds(requests: Sequence[Request], distinct: bool) -> list[list[int]]:
    """Split a batch into statements: positions of ``requests``, each list holding an operation at most once
    (``distinct``; the n-th request for an operation goes in the n-th statement, keeping the order they were
    made), sorted by operation id."""
    if not distinct:
        return [sorted(range(len(requests)), key=lambda i: requests[i][0])]
    rounds: list[list[int]] = []
    seen: dict[str, int] = {}
    for i, request in enumerate(requests):
        n = seen.get(request[0], 0)
        seen[request[0]] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(i)
    for positions in rounds:
        positions.sort(key=lambda i: requests[i][0])
    return rounds


def by_position(rows: Sequence[asyncpg.Record], n: int) -> list[asyncpg.Record | None]:
    """The rows of a batched statement (column ``i``, from 1) placed at their request's position; None where a
    request returned no row."""
    placed: list[asyncpg.Record | None] = [None] * n
    for row in rows:
        placed[row["i"] - 1] = row
    return placed


def columns(requests: Sequence[Request], width: int) -> list[list[Any]]:
    """The parallel arrays of a batched statement: column ``k`` of every request."""
    return [[request[k] for request in requests] for k in range(width)]


@dataclass(frozen=True)
class BatchedStatement:
    """One batched statement, declared: its ``name`` (the stage, the metrics' label), its ``query`` over parallel
    arrays, the query's array parameters in the order of a request's fields (``columns``, the operation id's
    first), how the rows become one result per request (``results``), and whether an operation may appear only
    once per statement (``distinct``).

    Raises:
        ValueError: ``columns``, with ``lock_timeout`` and, when the query takes it, ``worker``, are not exactly
            the query's parameters (checked when declared, at import).
    """

    name: str
    query: Query
    columns: tuple[str, ...]
    results: Callable[[list[asyncpg.Record], list[Request]], list[Any]]
    distinct: bool = True

    def __post_init__(self) -> None:
        given = {*self.columns, "lock_timeout", *(("worker",) if "worker" in self.query.parameters else ())}
        if given != set(self.query.parameters) or len(self.columns) != len(set(self.columns)):
            raise ValueError(
                f"batched statement {self.name}: columns {self.columns} do not match the parameters of "
                f"{self.query.source}:{self.query.name} {self.query.parameters}"
            )

    def bind(self, pool: asyncpg.Pool, worker: str) -> Statement:
        """The statement as the engine runs it on ``pool`` for ``worker``: (requests, lock_timeout) -> results."""
        takes_worker = "worker" in self.query.parameters

        async def run(batch: list[Request], lock_timeout: str) -> list[Any]:
            values: dict[str, Any] = dict(zip(self.columns, columns(batch, len(self.columns)), strict=True))
            values["lock_timeout"] = lock_timeout
            if takes_worker:
                values["worker"] = worker
            return self.results(await self.query.fetch(pool, **values), batch)

        return run


class Batcher:
    """The ledger's batched statements by name: each a coalescing stage whose batches run as few statements as
    the rules above allow.

    Args:
        batching: False sends one statement per call (the same statements, one request each), as a reference
            for tests and measurements.
    """

    def __init__(self, *, batching: bool = True) -> None:
        self.batching = batching
        self._stages: dict[str, tuple[Statement, bool, Coalescer[Request, Any]]] = {}

    def stage(self, name: str, statement: Statement, *, distinct: bool = True) -> None:
        """Declare the batched statement ``name``; ``distinct``: an operation at most once per statement."""

        async def flush(requests: list[Request]) -> list[Any]:
            return await self._flush(name, statement, distinct, requests, BATCH_LOCK_TIMEOUT)

        coalescer: Coalescer[Request, Any] = Coalescer(
            f"ledger_{name}", flush, max_batch=BATCH_MAX, max_in_flight=BATCH_IN_FLIGHT, linger_s=LINGER_UNDER_LOAD_S
        )
        self._stages[name] = (statement, distinct, coalescer)

    async def submit(self, name: str, request: Request) -> Any:
        """One request of the stage ``name``: batched with the other tasks' (or alone without batching, or when
        its batch waited too long for a lock).

        Raises:
            LedgerDataError, LedgerUnavailableError: as the request's own statement would.
        """
        statement, distinct, coalescer = self._stages[name]
        if self.batching:
            result = await coalescer.submit(request)
            if result is not RUN_ALONE:
                return result
        (result,) = await self._flush(name, statement, distinct, [request], WAIT_FOR_LOCKS)
        if isinstance(result, BaseException):
            raise result
        return result

    async def drain(self) -> None:
        """Finish the batches on the wire or queued."""
        for _, _, coalescer in self._stages.values():
            await coalescer.drain()

    async def _flush(
        self, name: str, statement: Statement, distinct: bool, requests: list[Request], lock_timeout: str
    ) -> list[Any]:
        """Run ``requests`` as few statements as the rules allow (module docstring); one result, exception or
        :data:`RUN_ALONE` per request, in order."""
        results: list[Any] = [None] * len(requests)
        rounds = _rounds(requests, distinct)
        for n, positions in enumerate(rounds):
            batch = [requests[i] for i in positions]
            try:
                out = await self._run(name, statement, batch, lock_timeout)
            except LedgerDataError as exc:
                out = await self._one_by_one(name, statement, batch, lock_timeout) if len(batch) > 1 else [exc]
            except (LedgerUnavailableError, asyncpg.LockNotAvailableError) as exc:  # not sent: this one and later
                if isinstance(exc, asyncpg.LockNotAvailableError):
                    metrics.LEDGER_BATCH_FALLBACKS.labels(name, "lock_wait").inc()
                    log.info("%s: a batch waited more than %s for a lock; its requests run alone", name, lock_timeout)
                for later in rounds[n:]:
                    for i in later:
                        results[i] = exc if isinstance(exc, LedgerUnavailableError) else RUN_ALONE
                return results
            for i, result in zip(positions, out, strict=True):
                results[i] = result
        return results

    async def _one_by_one(self, name: str, statement: Statement, batch: list[Request], lock_timeout: str) -> list[Any]:
        """PostgreSQL refused a batch for some request's values: each request alone, so only it fails."""
        metrics.LEDGER_BATCH_FALLBACKS.labels(name, "refused_value").inc()
        out: list[Any] = []
        for k, request in enumerate(batch):
            try:
                out.extend(await self._run(name, statement, [request], lock_timeout))
            except LedgerDataError as exc:
                out.append(exc)
            except asyncpg.LockNotAvailableError:
                out.append(RUN_ALONE)
            except LedgerUnavailableError as exc:
                out.extend([exc] * (len(batch) - k))
                break
        return out

    async def _run(self, name: str, statement: Statement, batch: list[Request], lock_timeout: str) -> list[Any]:
        """One statement; run again when PostgreSQL rolled it back as a deadlock victim or serialization failure.

        Raises:
            LedgerDataError: PostgreSQL refused a value. LedgerUnavailableError: it did not answer, or the
                statement kept being rolled back (:data:`CONFLICT_ATTEMPTS`). asyncpg.LockNotAvailableError: it
                waited ``lock_timeout`` for a lock (nothing written).
        """
        what = f"{name} of {batch[0][0]}" if len(batch) == 1 else f"{name} of {len(batch)} operations"
        for attempt in range(1, CONFLICT_ATTEMPTS + 1):
            try:
                async with guard(what):
                    return await statement(batch, lock_timeout)
            except asyncpg.TransactionRollbackError as exc:  # class 40: rolled back, nothing written
                metrics.LEDGER_CONFLICTS.labels(name, exc.sqlstate).inc()
                if attempt == CONFLICT_ATTEMPTS:
                    raise LedgerUnavailableError(
                        f"{what} rolled back {attempt} times in a row ({error_summary(exc)}); nothing was "
                        "written; retrying later"
                    ) from exc
                log.warning("%s rolled back (%s); running it again", what, error_summary(exc))
                await asyncio.sleep(random.uniform(0, 0.005 * 2**attempt))
        raise AssertionError("unreachable")  # pragma: no cover
