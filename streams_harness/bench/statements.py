"""PostgreSQL's statement profile of a benchmark run, from ``pg_stat_statements``.

The run's databases' top-level statements are read beside the services' CPU: when the submissions start and once
every operation is final, before the measured processes stop. The difference, per operation, is the profile: for
each statement its calls, execution time (ms, PostgreSQL's ``total_exec_time``: planning, the protocol and the
commit's WAL flush are not in it) and rows per call. A statement is named by its query in the project's ``.sql``
files (``ledger.sql:save_observation``), found by comparing the texts with their values blanked
(:func:`statement_shape`), else by the client library's name for it (:data:`LIBRARY_STATEMENTS`), else by the
start of its text with its values blanked: no value of the run appears in a name, even of a statement PostgreSQL
does not normalize (a utility statement's). The benchmark's own reading (:data:`OWN_QUERIES`) is left out.

Needs PostgreSQL 14 or later with the module loaded (``shared_preload_libraries=pg_stat_statements``, as
``scripts/services`` and ``compose/docker-compose.yml`` start PostgreSQL) and a superuser to create the extension
in the run's database (it is not a trusted extension). Without them, or when PostgreSQL evicted or reset entries
between the two readings (``pg_stat_statements_info``), the run's figures are ``null``
(:data:`STATEMENTS_UNREAD`) and the benchmark says why once.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from importlib.resources.abc import Traversable

import asyncpg

from streams.errors import StreamsError, error_summary
from streams.ledger.pool import connect
from streams.ledger.sql import Queries
from streams_harness.bench.counters import BENCH

#: The benchmark's own reading, run in the run's database while it is measured: not the measured programs'.
OWN_QUERIES = frozenset({"bench.sql:statement_statistics"})

#: The packages whose ``queries/*.sql`` files (at any depth) name the statements.
QUERY_PACKAGES = ("streams", "streams_harness")

#: Statements of the client library, by the start of their text: asyncpg's look-up of a connection's types (run
#: on a connection's first use of a type it has not seen, e.g. an enum) and its JIT switch around that look-up.
LIBRARY_STATEMENTS = {
    "WITH RECURSIVE typeinfo_tree(": "asyncpg:type_introspection",
    "SELECT current_setting($1) AS cur, set_config(": "asyncpg:introspection_jit_off",
}

#: Characters of a statement's blanked text that name a statement no ``.sql`` file holds.
UNNAMED_TEXT_CHARS = 60

#: Statements listed per run in the report, by execution time (the rest summed in the totals).
LISTED_STATEMENTS = 12

#: Statements printed per configuration (the report lists :data:`LISTED_STATEMENTS`).
PRINTED_STATEMENTS = 5

#: The report's statement figures of a run whose statements could not be read.
STATEMENTS_UNREAD: dict[str, object] = {
    "postgres_statements_per_operation": None,
    "postgres_exec_ms_per_operation": None,
    "postgres_statements": None,
}

#: A string constant (with its ``E``/``B``/``X``/``N``/``U&`` prefix and its continuations on the next lines, which
#: PostgreSQL reads as one constant) or a ``--`` comment (dropped: PostgreSQL keeps the first text it saw).
_STRING_OR_COMMENT = re.compile(r"(?:\b(?:[EBXN]|U&))?'(?:[^']|'')*'(?:\s*\n\s*'(?:[^']|'')*')*|--[^\n]*", re.I)
#: A ``$n`` parameter, a number standing alone (``1``, ``2.5``, ``.5``, ``1e3``), a boolean, or a NULL value (not
#: ``IS [NOT] NULL``): each a constant PostgreSQL replaces by a parameter.
_VALUE = re.compile(
    r"\$\d+|(?<![\w.$])(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?(?![\w.])|\b(?:true|false)\b|(?<!IS )(?<!NOT )\bNULL\b", re.I
)
#: The field of ``extract(<field> FROM ...)``, which PostgreSQL reads as a string constant.
_EXTRACT_FIELD = re.compile(r"\b(extract\s*\(\s*)\w+(\s+FROM\b)", re.I)
#: A minus sign before a blanked constant where it can only be unary (PostgreSQL replaces ``-1`` whole).
_UNARY_MINUS = re.compile(r"((?:^|[=<>(,\[]|\b(?:THEN|ELSE|WHEN|AND|OR|SELECT|RETURN)\b)\s*)-\s*\?", re.I)


def statement_shape(sql: str) -> str:
    """``sql`` with its comments dropped, its values blanked (string constants, ``$n`` parameters, numbers, booleans,
    NULL values, ``extract`` fields and a unary minus before one: ``?``), its whitespace collapsed and a final ``;``
    dropped: equal for a query as the project sends it and as ``pg_stat_statements`` shows it."""
    text = _STRING_OR_COMMENT.sub(lambda m: "" if m.group().startswith("--") else "?", sql)
    text = _EXTRACT_FIELD.sub(r"\1?\2", text)
    text = _UNARY_MINUS.sub(r"\1?", _VALUE.sub("?", text))
    return " ".join(text.split()).rstrip(";").rstrip()


def _query_files(directory: Traversable, package: str) -> Iterator[Queries]:
    """The :class:`Queries` of every ``queries/*.sql`` file under ``directory`` (the files of ``package``)."""
    for entry in directory.iterdir():
        if not entry.is_dir() or entry.name.startswith(("_", ".")):
            continue
        if entry.name == "queries":
            for file in sorted(entry.iterdir(), key=lambda f: f.name):
                if file.name.endswith(".sql"):
                    yield Queries(file.name, package=package)
        else:
            yield from _query_files(entry, f"{package}.{entry.name}")


def query_files() -> list[Queries]:
    """Every query file of :data:`QUERY_PACKAGES`, found on disk (a file added later is found too)."""
    return [queries for package in QUERY_PACKAGES for queries in _query_files(resources.files(package), package)]


def known_queries() -> dict[str, str]:
    """``statement_shape(sql) -> "<file>:<query name>"`` of every query of :func:`query_files`."""
    return {statement_shape(q.sql): f"{source.filename}:{q.name}" for source in query_files() for q in source.all()}


def statement_name(text: str, names: Mapping[str, str]) -> str:
    """The name of PostgreSQL's ``text`` of a statement: its query's in ``names`` (:func:`known_queries`), the
    client library's (:data:`LIBRARY_STATEMENTS`), else the first :data:`UNNAMED_TEXT_CHARS` characters of its
    shape (its values blanked)."""
    shape = statement_shape(text)
    if shape in names:
        return names[shape]
    collapsed = " ".join(text.split())
    for start, name in LIBRARY_STATEMENTS.items():
        if collapsed.startswith(start):
            return name
    return shape if len(shape) <= UNNAMED_TEXT_CHARS else shape[: UNNAMED_TEXT_CHARS - 3] + "..."


@dataclass(frozen=True)
class Statement:
    """One statement's totals: ``calls``, ``exec_ms`` and ``rows``."""

    name: str
    calls: int
    exec_ms: float
    rows: int


@dataclass(frozen=True)
class Reading:
    """One reading: ``queryid -> Statement``, and the view's own record (``pg_stat_statements_info``) of entries
    evicted (``dealloc``) and of its last reset (``stats_reset``): a change of either between two readings makes
    their difference wrong."""

    statements: dict[int, Statement]
    dealloc: int
    stats_reset: datetime | None


class StatementReader:
    """Reads the statements of ``databases`` over one connection to the run's database, whose statement is
    prepared by the first :meth:`read`: each later reading is one transaction of that database."""

    def __init__(self, conn: asyncpg.Connection, databases: list[str], names: Mapping[str, str]) -> None:
        self._conn = conn
        self._databases = databases
        self._names = names

    async def read(self) -> Reading:
        """The statements now (the benchmark's own, :data:`OWN_QUERIES`, left out)."""
        rows = await BENCH.statement_statistics.fetch(self._conn, databases=self._databases)
        statements: dict[int, Statement] = {}
        for row in rows:
            if row["queryid"] is None:  # the view's record alone: no statement yet
                continue
            name = statement_name(row["query"], self._names)
            if name not in OWN_QUERIES:
                statements[row["queryid"]] = Statement(name, row["calls"], row["exec_ms"], row["rows"])
        return Reading(statements, rows[0]["dealloc"], rows[0]["stats_reset"])

    async def close(self) -> None:
        """Close the connection; a connection already broken closes quietly."""
        try:
            await self._conn.close()
        except (asyncpg.InterfaceError, OSError):
            self._conn.terminate()


#: What opening or using a :class:`StatementReader` raises when the profile cannot be read: PostgreSQL refused
#: (no such view, no privilege), the connection failed or ended, or :func:`streams.ledger.pool.connect`'s errors.
READER_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, StreamsError)


async def open_reader(database_url: str, databases: list[str], names: Mapping[str, str]) -> StatementReader:
    """A reader of ``databases``' statements over a new connection to ``database_url`` (a run's database, where
    the extension is created), its statement prepared by a first reading.

    Raises:
        One of :data:`READER_ERRORS` (the connection is closed then).
    """
    conn = await connect(database_url)
    try:
        await BENCH.create_statement_statistics.execute(conn)
        reader = StatementReader(conn, databases, names)
        await reader.read()
    except BaseException:
        await conn.close()
        raise
    return reader


def reader_error(exc: BaseException) -> str:
    """Why the profile cannot be read, in one line: the error's type and its message's first line (PostgreSQL's
    or the ledger's connection errors, which name no password)."""
    return error_summary(exc).splitlines()[0]


def changed_between(before: Reading, after: Reading) -> str | None:
    """Why the difference of two readings is wrong (PostgreSQL evicted entries, at ``pg_stat_statements.max``, or
    reset them), or None."""
    if after.stats_reset != before.stats_reset:
        return "its statistics were reset during the run"
    if after.dealloc != before.dealloc:
        return f"it evicted entries during the run ({after.dealloc - before.dealloc} times; pg_stat_statements.max)"
    return None


def statement_figures(
    before: Mapping[int, Statement], after: Mapping[int, Statement], operations: int
) -> dict[str, object]:
    """The report's figures of the statements run between two readings, per operation:
    ``postgres_statements_per_operation`` (calls), ``postgres_exec_ms_per_operation`` (execution time) and
    ``postgres_statements`` (the :data:`LISTED_STATEMENTS` with the most execution time: ``statement``,
    ``calls_per_operation``, ``exec_ms_per_operation``, ``exec_ms_per_call``, ``rows_per_call``). Statements
    of one name are summed (texts that differ only in values; unnamed ones whose shapes begin alike). An entry
    with fewer calls than before was made anew in between and counts whole."""
    by_name: dict[str, list[float]] = {}
    for queryid, stat in after.items():
        prior = before.get(queryid)
        if prior is not None and prior.calls > stat.calls:
            prior = None
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
