"""The ledger's figures of the worker's periodic snapshot (``queries/snapshot.sql``): operations by state with
the oldest's age, and the outbox backlog with its oldest row's age. Two aggregate statements per call, read-only.
Also the readiness probe, and the worker's clock measured against the database's (:func:`read_clock_offset`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from streams.ledger.pool import guard as ledger_guard  # PostgreSQL errors -> LedgerUnavailableError/LedgerDataError
from streams.ledger.sql import Queries

SNAPSHOT = Queries("snapshot.sql")


@dataclass(frozen=True)
class LedgerFigures:
    """What the ledger holds at one moment: ``operations`` {state: count} (states without operations absent),
    ``oldest_age_s`` {state: seconds the oldest operation has been in it}, the outbox's ``unpublished`` rows
    and ``outbox_oldest_age_s`` (None when every row is published). Ages on the database's clock."""

    operations: dict[str, int]
    oldest_age_s: dict[str, float]
    unpublished: int
    outbox_oldest_age_s: float | None


async def read_figures(pool: asyncpg.Pool) -> LedgerFigures:
    """The ledger's figures now.

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    async with ledger_guard("read the snapshot's figures"):
        states = await SNAPSHOT.state_figures.fetch(pool)
        outbox = await SNAPSHOT.outbox_figures.fetchrow(pool)
    assert outbox is not None  # an aggregate without GROUP BY returns one row
    return LedgerFigures(
        operations={r["state"]: r["operations"] for r in states},
        oldest_age_s={r["state"]: r["oldest_age_s"] for r in states},
        unpublished=outbox["unpublished"],
        outbox_oldest_age_s=outbox["oldest_age_s"],
    )


async def ping(pool: asyncpg.Pool) -> None:
    """Return once PostgreSQL answers a statement on ``pool``.

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    async with ledger_guard("answer the readiness probe"):
        await SNAPSHOT.ping.fetchval(pool)


#: Readings of the database's clock per measurement; the one with the shortest round trip is kept (NTP's rule:
#: the least delayed sample bounds the error best).
CLOCK_SAMPLES = 3


@dataclass(frozen=True)
class ClockOffset:
    """This process's wall clock against PostgreSQL's: ``skew_s`` = local - database (seconds; positive: this
    clock is ahead), read at the middle of the round trip, so its error is at most ``round_trip_s / 2``."""

    skew_s: float
    round_trip_s: float


async def read_clock_offset(
    pool: asyncpg.Pool, samples: int = CLOCK_SAMPLES, clock: Callable[[], float] = time.time
) -> ClockOffset:
    """Measure ``clock`` (default the wall clock, ``time.time()``, seconds since the epoch) against the database's
    ``clock_timestamp()``: ``samples`` (>= 1) readings on one connection, the one with the shortest round trip
    kept, each corrected by half its round trip.

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    best: ClockOffset | None = None
    async with ledger_guard("read the database's clock"), pool.acquire() as conn:
        for _ in range(max(1, samples)):
            sent = clock()
            database_s: float = await SNAPSHOT.clock_now.fetchval(conn)
            answered = clock()
            round_trip_s = max(0.0, answered - sent)
            reading = ClockOffset(sent + round_trip_s / 2 - database_s, round_trip_s)
            if best is None or reading.round_trip_s < best.round_trip_s:
                best = reading
    assert best is not None  # at least one sample
    return best
