"""Every named query, as aiosql converted it, is a statement PostgreSQL accepts on the migrated ledger, taking
exactly one parameter per name (the harness's queries included: nothing else runs the benchmark's)."""

from __future__ import annotations

import asyncpg
import pytest

from streams.ledger.sql import Queries, Query

pytestmark = pytest.mark.integration

FILES = [
    Queries(filename, package)
    for package, filename in [
        ("streams.ledger", "ledger.sql"),
        ("streams.ledger", "operators.sql"),
        ("streams.ledger", "accounting.sql"),
        ("streams.ledger", "reconcile.sql"),
        ("streams.ledger", "inspect.sql"),
        ("streams_harness", "report.sql"),
        ("streams_harness", "bench.sql"),
    ]
]
QUERIES = [q for queries in FILES for q in queries.all()]


@pytest.mark.parametrize("query", QUERIES, ids=[f"{q.source}:{q.name}" for q in QUERIES])
async def test_postgresql_prepares_it_with_one_parameter_per_name(pool: asyncpg.Pool, query: Query) -> None:
    async with pool.acquire() as conn:
        statement = await conn.prepare(query.sql)
        assert len(statement.get_parameters()) == len(query.parameters)
