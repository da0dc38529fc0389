"""Named SQL queries kept in ``<package>/queries/*.sql`` (procrastinate's layout), read as package resources.

A file holds several queries; each begins with a line ``-- name: <query_name>`` and runs until the next one.
"""

from __future__ import annotations

import re
from importlib import resources

_NAME_LINE = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


def parse_queries(text: str) -> dict[str, str]:
    """Split ``text`` into ``{name: sql}``.

    Raises:
        ValueError: a name appears twice or a named query is empty.
    """
    queries: dict[str, str] = {}
    matches = list(_NAME_LINE.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip()
        name = match.group(1)
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        if not body:
            raise ValueError(f"query {name!r} is empty")
        queries[name] = body
    return queries


def load_queries(filename: str, package: str = "streams") -> dict[str, str]:
    """Load the named queries of ``<package>/queries/<filename>`` (a package resource).

    Raises:
        FileNotFoundError: the installation lacks the file.
    """
    text = resources.files(package).joinpath("queries", filename).read_text(encoding="utf-8")
    return parse_queries(text)


class Queries:
    """Attribute access to the named queries of one file: ``Q.claim_for_submit`` is its SQL text."""

    def __init__(self, filename: str, package: str = "streams") -> None:
        self._queries = load_queries(filename, package)

    def __getattr__(self, name: str) -> str:
        try:
            return self._queries[name]
        except KeyError:
            raise AttributeError(f"no query named {name!r}") from None

    def names(self) -> list[str]:
        """The query names, in file order."""
        return list(self._queries)


LEDGER = Queries("ledger.sql")
OPERATORS = Queries("operators.sql")
ACCOUNTING = Queries("accounting.sql")
RECONCILE = Queries("reconcile.sql")
