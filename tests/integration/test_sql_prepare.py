"""Every named query of every ``queries/*.sql`` file, as aiosql converted it, is a statement PostgreSQL accepts on the
migrated ledger, taking exactly one parameter per name (the harness's queries included: nothing else runs the
benchmark's; with pg_stat_statements, which the project's PostgreSQL loads, for the benchmark's statement
profile)."""

from __future__ import annotations

import asyncpg
import pytest

from streams.ledger.sql import Query
from streams_harness.bench.counters import BENCH
from streams_harness.bench.statements import query_files

pytestmark = pytest.mark.integration

QUERIES = [q for queries in query_files() for q in queries.all()]


@pytest.mark.parametrize("query", QUERIES, ids=[f"{q.source}:{q.name}" for q in QUERIES])
async def test_postgresql_prepares_it_with_one_parameter_per_name(pool: asyncpg.Pool, query: Query) -> None:
    async with pool.acquire() as conn:
        if query.source == BENCH.statement_statistics.source:
            await BENCH.create_statement_statistics.execute(conn)
        statement = await conn.prepare(query.sql)
        assert len(statement.get_parameters()) == len(query.parameters)
