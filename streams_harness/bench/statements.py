"""PostgreSQL's statement profile of a benchmark run, from ``pg_stat_statements``.

The run's databases' top-level statements are read when the submissions start and once every operation is final;
the difference, per operation, is the profile: for each statement its calls, execution time (ms, PostgreSQL's
``total_exec_time``: planning, the protocol and the commit's WAL flush are not in it) and rows per call. A
statement is named by its query in the project's ``.sql`` files (``ledger.sql:save_observation``), found by
comparing the texts with literals and parameters blanked, else by the start of PostgreSQL's own text of it, whose
constants PostgreSQL replaced by ``$n``: no value of the run appears in either. The benchmark's own readings
(:data:`OWN_QUERIES`) are left out.

Needs the module loaded (``shared_preload_libraries=pg_stat_statements``, as ``scripts/services`` and
``compose/docker-compose.yml`` start PostgreSQL) and the extension created in the run's database (by the
benchmark: a role allowed to create it); without either, :func:`read_statements` answers None with the reason
and the report says ``null``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import asyncpg

from streams.ledger import sql as ledger_sql
from streams_harness.bench.counters import BENCH
from streams_harness.report import REPORT

#: The benchmark's own queries that run in a run's database while it is measured: not the measured programs'.
OWN_QUERIES = frozenset({"bench.sql:statement_statistics", "report.sql:run_progress"})

#: Statements of the client library, by the start of their text: asyncpg's look-up of a connection's types (run
#: on a connection's first use of a type it has not seen, e.g. an enum) and its JIT switch around that look-up.
LIBRARY_STATEMENTS = {
    "WITH RECURSIVE typeinfo_tree(": "asyncpg:type_introspection",
    "SELECT current_setting($1) AS cur, set_config(": "asyncpg:introspection_jit_off",
}

#: Characters of PostgreSQL's text that name a statement no ``.sql`` file holds.
UNNAMED_TEXT_CHARS = 60

#: Statements listed per run in the report, by execution time (the rest summed in the totals).
LISTED_STATEMENTS = 12

#: The report's statement figures of a run whose statements could not be read.
STATEMENTS_UNREAD: dict[str, object] = {
    "postgres_statements_per_operation": None,
    "postgres_exec_ms_per_operation": None,
    "postgres_statements": None,
}

#: A string literal, a ``$n`` parameter, a number standing alone, a boolean, a NULL value (not ``IS [NOT] NULL``) or
#: the field of ``extract(<field> FROM ...)``: blanked before two texts are compared (PostgreSQL replaces each
#: constant of a statement by a parameter).
_VALUE = re.compile(
    r"'(?:[^']|'')*'|\$\d+|(?<![\w.])\d+(?:\.\d+)?(?![\w.])|\b(?:true|false)\b|(?<!IS )(?<!NOT )\bNULL\b"
    r"|(?<=extract\()\w+(?=\s+FROM\b)",
    re.IGNORECASE,
)


def statement_shape(sql: str) -> str:
    """``sql`` with its values blanked (:data:`_VALUE`: ``?``), its whitespace collapsed and a final ``;``
    dropped: equal for a query as the project sends it and as ``pg_stat_statements`` shows it."""
    return " ".join(_VALUE.sub("?", sql).split()).rstrip(";").rstrip()


def query_names(queries: Iterable[ledger_sql.Queries]) -> dict[str, str]:
    """``statement_shape(sql) -> "<file>:<query name>"`` of every query of ``queries``."""
    return {statement_shape(q.sql): f"{source.filename}:{q.name}" for source in queries for q in source.all()}


def known_queries() -> dict[str, str]:
    """:func:`query_names` of the product's query files and the benchmark's own."""
    files = [value for value in vars(ledger_sql).values() if isinstance(value, ledger_sql.Queries)]
    return query_names([*files, BENCH, REPORT])


@dataclass(frozen=True)
class Statement:
    """One statement's totals: ``calls``, ``exec_ms`` and ``rows``."""

    name: str
    calls: int
    exec_ms: float
    rows: int


def statement_name(text: str, names: Mapping[str, str]) -> str:
    """The name of PostgreSQL's ``text`` of a statement: its query's in ``names`` (:func:`query_names`), the client
    library's (:data:`LIBRARY_STATEMENTS`), else its first :data:`UNNAMED_TEXT_CHARS` characters, whitespace
    collapsed."""
    shape = statement_shape(text)
    if shape in names:
        return names[shape]
    collapsed = " ".join(text.split())
    for start, name in LIBRARY_STATEMENTS.items():
        if collapsed.startswith(start):
            return name
    return collapsed if len(collapsed) <= UNNAMED_TEXT_CHARS else collapsed[: UNNAMED_TEXT_CHARS - 3] + "..."


async def create_statement_statistics(database_url: str) -> str | None:
    """Create the extension in the database of ``database_url`` and read its view once; returns None when it
    reads, else why it cannot (the error's class and first line: no credentials in it)."""
    try:
        conn = await asyncpg.connect(database_url)
    except (OSError, asyncpg.PostgresError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    try:
        await BENCH.create_statement_statistics.execute(conn)
        await BENCH.statement_statistics.fetch(conn, databases=[])
    except asyncpg.PostgresError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        await conn.close()
    return None


async def read_statements(database_url: str, databases: list[str], names: Mapping[str, str]) -> dict[int, Statement]:
    """``queryid -> Statement`` of the top-level statements run in ``databases`` (names), read over a connection
    to ``database_url`` (where :func:`create_statement_statistics` created the extension); the benchmark's own
    (:data:`OWN_QUERIES`) left out."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await BENCH.statement_statistics.fetch(conn, databases=databases)
    finally:
        await conn.close()
    read: dict[int, Statement] = {}
    for row in rows:
        name = statement_name(row["query"], names)
        if name not in OWN_QUERIES:
            read[row["queryid"]] = Statement(name, row["calls"], row["exec_ms"], row["rows"])
    return read


def statement_figures(
    before: Mapping[int, Statement], after: Mapping[int, Statement], operations: int
) -> dict[str, object]:
    """The report's figures of the statements run between two readings, per operation:
    ``postgres_statements_per_operation`` (calls), ``postgres_exec_ms_per_operation`` (execution time) and
    ``postgres_statements`` (the :data:`LISTED_STATEMENTS` with the most execution time: ``statement``,
    ``calls_per_operation``, ``exec_ms_per_operation``, ``exec_ms_per_call``, ``rows_per_call``). Statements
    of one name (texts that differ only in values) are summed."""
    by_name: dict[str, list[float]] = {}
    for queryid, stat in after.items():
        prior = before.get(queryid)
        calls = stat.calls - (prior.calls if prior else 0)
        if calls <= 0:
            continue
        totals = by_name.setdefault(stat.name, [0, 0.0, 0])
        totals[0] += calls
        totals[1] += stat.exec_ms - (prior.exec_ms if prior else 0.0)
        totals[2] += stat.rows - (prior.rows if prior else 0)
    n = max(operations, 1)
    ranked = sorted(by_name.items(), key=lambda item: item[1][1], reverse=True)
    return {
        "postgres_statements_per_operation": round(sum(t[0] for t in by_name.values()) / n, 2),
        "postgres_exec_ms_per_operation": round(sum(t[1] for t in by_name.values()) / n, 3),
        "postgres_statements": [
            {
                "statement": name,
                "calls_per_operation": round(calls / n, 3),
                "exec_ms_per_operation": round(exec_ms / n, 4),
                "exec_ms_per_call": round(exec_ms / calls, 4),
                "rows_per_call": round(rows / calls, 1),
            }
            for name, (calls, exec_ms, rows) in ranked[:LISTED_STATEMENTS]
        ],
    }


#: Statements printed per configuration (the report lists :data:`LISTED_STATEMENTS`).
PRINTED_STATEMENTS = 5


def render_statements(records: list[dict[str, object]]) -> str:
    """The first run of each configuration's statement profile (:func:`statement_figures`) as fixed-width lines:
    its totals, then its :data:`PRINTED_STATEMENTS` statements with the most execution time; empty when no run
    has one."""
    header = f"{'PostgreSQL statements (first run)':<58} {'calls/op':>8} {'exec ms/op':>10} {'ms/call':>8}"
    lines: list[str] = []
    seen: set[object] = set()
    for record in records:
        statements = record.get("postgres_statements")
        if record["label"] in seen or not isinstance(statements, list):
            continue
        seen.add(record["label"])
        lines.append(
            f"{record['label']:<58} {record['postgres_statements_per_operation']:>8.2f} "
            f"{record['postgres_exec_ms_per_operation']:>10.3f}"
        )
        for s in statements[:PRINTED_STATEMENTS]:
            lines.append(
                f"  {s['statement']:<56} {s['calls_per_operation']:>8.3f} {s['exec_ms_per_operation']:>10.4f} "
                f"{s['exec_ms_per_call']:>8.3f}"
            )
    return "\n".join([header, "-" * len(header), *lines]) if lines else ""
