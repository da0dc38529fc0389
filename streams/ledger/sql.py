"""Named SQL queries kept in ``<package>/queries/*.sql`` (procrastinate's layout), read as package resources and
parsed by aiosql (its asyncpg adapter).

A file holds several queries; each begins with a line ``-- name: <query_name>`` (``<query_name>!`` for a
statement without a result, aiosql's mark), and the comment lines after it document the query: its named
parameters (``:operation_id``) and its result. aiosql turns the named parameters into asyncpg's ``$1..$n`` once,
when the file is loaded; a call names every parameter, and one missing or unknown fails loudly
(:class:`QueryParametersError`) before anything is sent::

    row = await LEDGER.get_operation.fetchrow(pool, operation_id=operation_id)

The call goes straight to asyncpg (``fetch``/``fetchrow``/``fetchval``/``execute`` of a pool or a connection)
with the parameters in the order aiosql numbered them, not through aiosql's own call path, which costs more on
the hot path and checks less: it looks the connection up with ``dir()`` on every call and silently ignores a
parameter given but not used. Python time of one call, with a connection that answers at once (a shared 2-core
machine, so noisy): positional asyncpg call 0.3 us (one row) / 1.6 us (a batch's arrays); by name here 1.7 /
3.3 us; through aiosql 6.5 / 9.0 us, plus 7.5 us for ``dir()`` of a pool.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources
from typing import Any, TypeAlias

import aiosql
import asyncpg
from aiosql.adapters.asyncpg import AsyncPGAdapter

from streams.errors import QueryParametersError

#: Where a query runs: a pool (one connection for the statement) or a connection (its transaction).
Executor: TypeAlias = "asyncpg.Pool | asyncpg.Connection"


class Query:
    """One named query: ``sql`` as sent (``$1..$n``), ``parameters`` (the names, in ``$n`` order) and ``doc``
    (its comment lines: the parameters' meaning and the result).

    Its methods are asyncpg's, with the parameters by name. Raises :class:`QueryParametersError` when the
    names given are not exactly ``parameters``; asyncpg's and PostgreSQL's errors pass through unchanged (the
    ledger maps them, ``streams.ledger.pool.guard``).
    """

    __slots__ = ("_names", "doc", "name", "parameters", "source", "sql")

    def __init__(self, name: str, sql: str, parameters: tuple[str, ...], doc: str, source: str) -> None:
        self.name = name
        self.sql = sql
        self.parameters = parameters
        self.doc = doc
        self.source = source
        self._names = frozenset(parameters)

    def __repr__(self) -> str:
        return f"Query({self.source}:{self.name}({', '.join(self.parameters)}))"

    def arguments(self, values: Mapping[str, Any]) -> list[Any]:
        """``values`` (name -> value) as the positional arguments of :attr:`sql`.

        Raises:
            QueryParametersError: a parameter is missing from ``values``, or ``values`` names one the query does
                not take.
        """
        if values.keys() != self._names:
            missing = sorted(self._names - values.keys())
            unknown = sorted(values.keys() - self._names)
            raise QueryParametersError(self.source, self.name, missing, unknown)
        return [values[name] for name in self.parameters]

    async def fetch(self, db: Executor, /, **values: Any) -> list[asyncpg.Record]:
        """Every row (asyncpg ``fetch``)."""
        rows: list[asyncpg.Record] = await db.fetch(self.sql, *self.arguments(values))
        return rows

    async def fetchrow(self, db: Executor, /, **values: Any) -> asyncpg.Record | None:
        """The first row, or None (asyncpg ``fetchrow``)."""
        row: asyncpg.Record | None = await db.fetchrow(self.sql, *self.arguments(values))
        return row

    async def fetchval(self, db: Executor, /, **values: Any) -> Any:
        """The first column of the first row, or None (asyncpg ``fetchval``)."""
        return await db.fetchval(self.sql, *self.arguments(values))

    async def execute(self, db: Executor, /, **values: Any) -> str:
        """Run it for its effect; returns PostgreSQL's status line (asyncpg ``execute``)."""
        status: str = await db.execute(self.sql, *self.arguments(values))
        return status


def parse_queries(text: str, source: str = "<text>") -> dict[str, Query]:
    """The named queries of ``text`` (the content of one ``.sql`` file), in file order.

    aiosql reads ``:name`` outside quoted text and identifiers (``::type`` casts and ``:=`` are not parameters) and
    numbers the names in order of first use; its ``--`` lines after the name line are the query's ``doc``.

    Raises:
        aiosql.SQLLoadException: a name appears twice. aiosql.SQLParseException: a name line is malformed or a
            query is empty.
        ValueError: a query holds text aiosql would misread: a dollar-quoted string (aiosql rewrites ``:name``
            inside it), or a ``:<digits>`` it numbers without naming (an array slice).
    """
    adapter = AsyncPGAdapter()  # type: ignore[no-untyped-call]
    loaded = aiosql.from_str(text, lambda: adapter, mandatory_parameters=False, attribute=None)
    queries: dict[str, Query] = {}
    for name in re.findall(r"^--\s*name\s*:\s*(\w+)", text, re.MULTILINE):  # file order
        fn = getattr(loaded, name)
        if "$$" in fn.sql:
            raise ValueError(f"{source}: query {name!r} holds a dollar-quoted string, which aiosql would rewrite")
        parameters = tuple(adapter.var_sorted[name])
        if parameters != tuple(fn.__signature__.parameters)[1:]:  # what it numbered == what it names
            raise ValueError(f"{source}: query {name!r}: aiosql numbered {parameters}, an unnamed one among them")
        queries[name] = Query(name, fn.sql, parameters, fn.__doc__ or "", source)
    return queries


def load_queries(filename: str, package: str = "streams.ledger") -> dict[str, Query]:
    """The named queries of ``<package>/queries/<filename>`` (a package resource).

    Raises:
        FileNotFoundError: the installation lacks the file. And as :func:`parse_queries`.
    """
    text = resources.files(package).joinpath("queries", filename).read_text(encoding="utf-8")
    return parse_queries(text, query_path(package, filename))


def query_path(package: str, filename: str) -> str:
    """The source path of ``<package>/queries/<filename>`` as it reads in the repository (for messages)."""
    return f"{package.replace('.', '/')}/queries/{filename}"


class Queries:
    """Attribute access to the named queries of one file: ``LEDGER.claim_for_submit`` is its :class:`Query`."""

    def __init__(self, filename: str, package: str = "streams.ledger") -> None:
        self.filename = filename
        self.package = package
        self._queries = load_queries(filename, package)

    def __getattr__(self, name: str) -> Query:
        try:
            return self._queries[name]
        except KeyError:
            raise AttributeError(f"no query named {name!r} in {query_path(self.package, self.filename)}") from None

    def names(self) -> list[str]:
        """The query names, in file order."""
        return list(self._queries)

    def all(self) -> list[Query]:
        """The queries, in file order."""
        return list(self._queries.values())


LEDGER = Queries("ledger.sql")
OPERATORS = Queries("operators.sql")
ACCOUNTING = Queries("accounting.sql")
RECONCILE = Queries("reconcile.sql")
INSPECT = Queries("inspect.sql")
RETENTION = Queries("retention.sql")
REDRIVES = Queries("redrives.sql")
CANCELLATIONS = Queries("cancellations.sql")
CALLBACKS = Queries("callbacks.sql")
