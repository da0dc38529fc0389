"""Databases next to the ledger's on the same server: whether one exists, and dropping one (``streams teardown``).

``DROP DATABASE`` takes its name as an identifier, which no query parameter can carry: the name is quoted here
(:func:`quote_identifier`), the only statement of the ledger package not in ``queries/*.sql``.
"""

from __future__ import annotations

import asyncpg

from streams.ledger.pool import connect, privilege_error
from streams.ledger.sql import Queries

DATABASES = Queries("databases.sql")


def quote_identifier(name: str) -> str:
    """``name`` as a PostgreSQL quoted identifier (``"a""b"`` for ``a"b``)."""
    return '"' + name.replace('"', '""') + '"'


async def drop_database(server_url: str, name: str, *, dry_run: bool = False) -> bool:
    """Drop database ``name`` (its connections terminated: ``WITH (FORCE)``) through a connection to
    ``server_url``'s database; returns whether it existed. On ``dry_run`` only looks.

    Raises:
        DatabaseConfigError, LedgerUnavailableError: as :func:`streams.ledger.pool.connect`.
        DatabasePrivilegeError: the role may not drop it (not its owner); it was not dropped.
    """
    conn = await connect(server_url)
    try:
        exists = bool(await DATABASES.database_exists.fetchval(conn, name=name))
        if exists and not dry_run:
            try:
                await conn.execute(f"DROP DATABASE IF EXISTS {quote_identifier(name)} WITH (FORCE)")
            except asyncpg.InsufficientPrivilegeError as exc:
                raise privilege_error(server_url, f"drop database {name}", exc, "it was not dropped") from exc
        return exists
    finally:
        await conn.close()
