"""The ledger's figures of the worker's periodic snapshot (``queries/snapshot.sql``): operations by state with
the oldest's age, and the outbox backlog with its oldest row's age. Two aggregate statements per call, read-only.
"""

from __future__ import annotations

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
