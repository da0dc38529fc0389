"""Re-driven dead letters on the ledger: the request an operation was accepted with (a re-drive must ask for the
same), and the record of each re-drive (table ``dead_letter_redrives``, ``migrations/0011.retention.sql``).

Queries of ``queries/redrives.sql``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import asyncpg

from streams.ledger.pool import guard
from streams.ledger.sql import REDRIVES

ValueSource = Literal["original", "file"]


@dataclass(frozen=True)
class Redrive:
    """One re-drive to record: the dead letter (topic, partition, offset, reason), the operation id its value
    names (None when it names none), where the value was published again, whether it was the dead letter's
    original value or a fixed one from a file, the value's SHA-256 (hex), why, and who (the actor)."""

    dead_letter_topic: str
    dead_letter_partition: int
    dead_letter_offset: int
    dead_letter_reason: str
    operation_id: str | None
    target_topic: str
    target_partition: int
    target_offset: int
    value_source: ValueSource
    value_sha256: str
    why: str
    actor: str


async def operation_request(pool: asyncpg.Pool, operation_id: str) -> str | None:
    """The request the ledger holds for ``operation_id`` (JSON text as submitted; ``null`` once erased), or None
    when it holds no such operation.

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    async with guard(f"read the request of {operation_id}"):
        request: str | None = await REDRIVES.operation_request.fetchval(pool, operation_id=operation_id)
    return request


async def posts_of(pool: asyncpg.Pool, operation_id: str) -> int:
    """How many POSTs the accounting recorded for ``operation_id`` (its rows outlive the operation's).

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    async with guard(f"read the POSTs of {operation_id}"):
        posts: int = await REDRIVES.posts_of.fetchval(pool, operation_id=operation_id)
    return posts


async def record_redrive(pool: asyncpg.Pool, redrive: Redrive) -> dict[str, Any]:
    """Record ``redrive``; returns ``{id, at}``.

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer. LedgerDataError: a value the table refuses (an empty
            why or actor).
    """
    async with guard(f"record the re-drive of {redrive.dead_letter_topic}[{redrive.dead_letter_partition}]"):
        row = await REDRIVES.record_redrive.fetchrow(
            pool,
            dead_letter_topic=redrive.dead_letter_topic,
            dead_letter_partition=redrive.dead_letter_partition,
            dead_letter_offset=redrive.dead_letter_offset,
            dead_letter_reason=redrive.dead_letter_reason,
            operation_id=redrive.operation_id,
            target_topic=redrive.target_topic,
            target_partition=redrive.target_partition,
            target_offset=redrive.target_offset,
            value_source=redrive.value_source,
            value_sha256=redrive.value_sha256,
            why=redrive.why,
            actor=redrive.actor,
        )
    assert row is not None
    return dict(row)


async def redrives_of(
    pool: asyncpg.Pool, dead_letter_topic: str, records: Sequence[tuple[int, int]]
) -> list[dict[str, Any]]:
    """Every re-drive recorded of the dead letters ``records`` ((partition, offset) of ``dead_letter_topic``),
    oldest first: ``[{dead_letter_partition, dead_letter_offset, operation_id, target_topic, target_partition,
    target_offset, value_source, value_sha256, why, actor, at}]``.

    Raises:
        LedgerUnavailableError: PostgreSQL did not answer.
    """
    async with guard(f"read the re-drives of {len(records)} dead letters"):
        rows = await REDRIVES.redrives_of.fetch(
            pool,
            dead_letter_topic=dead_letter_topic,
            dead_letter_partitions=[p for p, _ in records],
            dead_letter_offsets=[o for _, o in records],
        )
    return [dict(r) for r in rows]
