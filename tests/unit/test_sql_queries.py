"""Named SQL queries: the loader (aiosql's parsing and conversion of named parameters), every query file, and every
call site in the code (each names exactly the parameters of an existing query)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from streams.errors import QueryParametersError
from streams.ledger.batching import BatchedStatement
from streams.ledger.sql import LEDGER, Queries, Query, parse_queries, query_path
from streams.ledger.store import BATCHED

ROOT = Path(__file__).resolve().parents[2]

TEXT = """\
-- A header comment before the first query is ignored.

-- name: first_query
-- :id the row.
SELECT * FROM t WHERE id = :id;

-- name: second
-- :id, :x (text).
UPDATE t SET x = :x::text, y = ':not_a_parameter', "odd:name" = 1
WHERE id = :id AND z::text = 'a:b' AND w = ANY(:x::text[]);

-- name: third_one
SELECT 1;
"""


def test_parse_names_parameters_and_sql() -> None:
    queries = parse_queries(TEXT)
    assert list(queries) == ["first_query", "second", "third_one"]
    first, second, third = queries.values()
    assert first.sql == "SELECT * FROM t WHERE id = $1;"
    assert first.parameters == ("id",)
    assert first.doc == ":id the row."
    # Casts (::text), quoted text and quoted identifiers stay as they are; a name used twice is one parameter.
    assert second.sql == (
        "UPDATE t SET x = $1::text, y = ':not_a_parameter', \"odd:name\" = 1\n"
        "WHERE id = $2 AND z::text = 'a:b' AND w = ANY($1::text[]);"
    )
    assert second.parameters == ("x", "id")
    assert (third.sql, third.parameters) == ("SELECT 1;", ())


def test_dollar_quoted_text_is_refused() -> None:
    # aiosql would rewrite ":b" inside the dollar-quoted string; no query may hold one.
    with pytest.raises(ValueError, match="dollar-quoted"):
        parse_queries("-- name: a\nSELECT $$ :b $$, :c;\n")


def test_duplicate_name_is_an_error() -> None:
    with pytest.raises(Exception, match="a"):
        parse_queries("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")


def test_arguments_in_placeholder_order() -> None:
    second = parse_queries(TEXT)["second"]
    assert second.arguments({"id": 7, "x": "v"}) == ["v", 7]


@pytest.mark.parametrize(
    ("values", "missing", "unknown"),
    [({"x": "v"}, ["id"], []), ({"id": 1, "x": "v", "y": 2}, [], ["y"]), ({"ids": 1, "x": "v"}, ["id"], ["ids"])],
)
async def test_wrong_parameter_names_fail_loudly_before_sending(
    values: dict[str, Any], missing: list[str], unknown: list[str]
) -> None:
    second = parse_queries(TEXT, "test.sql")["second"]
    sent: list[Any] = []

    class Db:
        async def execute(self, *args: Any) -> str:
            sent.append(args)
            return "UPDATE 1"

    with pytest.raises(QueryParametersError) as info:
        await second.execute(Db(), **values)
    assert (info.value.missing, info.value.unknown, info.value.query) == (missing, unknown, "second")
    assert "query 'second' of test.sql called with the wrong parameters" in str(info.value)
    assert sent == []
    assert await second.execute(Db(), id=1, x="v") == "UPDATE 1"
    assert sent == [(second.sql, "v", 1)]


EXPECTED = {
    ("streams.ledger", "ledger.sql"): [
        "accept_operation",
        "claim_for_submit",
        "save_submitted",
        "record_late_job",
        "save_submission_without_job",
        "reconcile_stale_submitting",
        "claim_due_polls",
        "next_due_in_s",
        "get_operation",
        "note_erased_replay",
        "claim_for_observe",
        "reschedule_poll",
        "save_observation",
        "save_stalled",
        "note_not_found",
        "note_poll_setback",
        "record_remote_call",
        "lock_unpublished_outbox",
        "probe_outbox",
        "mark_outbox_published",
        "announce_transitions",
        "stale_accepted",
    ],
    ("streams.ledger", "operators.sql"): [
        "adopt",
        "abandon",
        "repoll",
        "fail_stalled",
        "operation_holding_job",
        "former_job_of_operation",
        "adopt_late_job",
        "late_jobs_of_operation",
    ],
    ("streams.ledger", "accounting.sql"): ["accounting_summary", "record_refund"],
    ("streams.ledger", "snapshot.sql"): ["state_figures", "outbox_figures", "ping", "clock_now"],
    ("streams.ledger", "reconcile.sql"): [
        "claim_due_lookups",
        "adopt_found_job",
        "give_up_lookup",
        "reschedule_lookup",
    ],
    ("streams.ledger", "databases.sql"): ["database_exists"],
    ("streams.ledger", "retention.sql"): [
        "database_role",
        "purge_preview",
        "purge_batch",
        "forget_ids_preview",
        "forget_ids_batch",
        "lock_for_erasure",
        "erase_operation",
        "erase_outputs",
        "record_erasure",
        "erasures_of",
    ],
    ("streams.ledger", "redrives.sql"): ["operation_request", "posts_of", "record_redrive", "redrives_of"],
    ("streams.ledger", "cancellations.sql"): ["request_cancel", "note_cancel_call"],
    ("streams.ledger", "callbacks.sql"): ["note_callback"],
    ("streams.ledger", "inspect.sql"): [
        "list_operations",
        "operation_row",
        "operation_transitions",
        "operation_outputs",
        "operation_remote_calls",
        "operation_remote_jobs",
        "state_counts",
        "state_queue",
        "late_jobs",
        "transitions_per_minute",
        "outbox_backlog",
        "database_now",
        "posts_per_operation",
    ],
    ("streams_harness", "report.sql"): [
        "run_operations",
        "run_publications",
        "run_progress",
        "try_main_job_lock",
        "run_transitions",
        "run_reconciled",
        "run_callbacks",
        "operation_states",
        "run_cancellations",
    ],
    ("streams_harness", "bench.sql"): [
        "floor_accept_many",
        "floor_claim_submit_many",
        "floor_save_submitted_many",
        "floor_claim_observe_many",
        "floor_save_observations_many",
        "floor_record_calls_many",
        "naive_mark_submitting",
        "naive_save_job",
        "naive_pollable",
        "naive_save_state",
        "naive_save_outputs",
        "peer_request",
        "peer_save_outputs_once",
        "database_transactions",
        "database_backends",
        "create_statement_statistics",
        "statement_statistics",
    ],
}

FILES = {key: Queries(key[1], package=key[0]) for key in EXPECTED}
ALL_QUERIES = [(f"{package}/{filename}", q) for (package, filename), qs in FILES.items() for q in qs.all()]


def test_every_query_file_is_listed() -> None:
    on_disk = {
        (".".join(p.parent.parent.relative_to(ROOT).parts), p.name)
        for p in (*ROOT.glob("*/queries/*.sql"), *ROOT.glob("*/*/queries/*.sql"))
    }
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_names_in_file_order(key: tuple[str, str]) -> None:
    assert FILES[key].names() == EXPECTED[key]


def test_attribute_access() -> None:
    assert LEDGER.claim_for_submit.sql.endswith("WHERE locked.state = 'submitting' AND locked.claim_id = req.claim_id;")
    assert LEDGER.claim_for_submit.parameters == ("operation_ids", "claim_ids", "lock_timeout", "worker")
    with pytest.raises(AttributeError, match=r"no query named 'nope' in streams/ledger/queries/ledger\.sql"):
        _ = LEDGER.nope


def _placeholders(sql: str) -> list[int]:
    code = re.sub(r"'(''|[^'])*'", "''", re.sub(r"--[^\n]*", "", sql))  # only the code counts
    return sorted({int(n) for n in re.findall(r"\$(\d+)", code)})


def test_placeholder_helper() -> None:
    assert _placeholders("-- $9 doc\nSELECT $1, '$4', $2 -- $7\n, $10") == [1, 2, 10]


@pytest.mark.parametrize(("source", "query"), ALL_QUERIES, ids=[f"{s}:{q.name}" for s, q in ALL_QUERIES])
def test_every_named_parameter_converted_and_documented(source: str, query: Query) -> None:
    """aiosql numbered every named parameter ($1..$n, one per name, none left as :name), and the query's comment
    documents each of them by name, and no other."""
    assert _placeholders(query.sql) == list(range(1, len(query.parameters) + 1)), query.sql
    code = re.sub(r"'(''|[^'])*'", "''", re.sub(r"--[^\n]*", "", query.sql))
    assert re.findall(r"(?<![:\w]):[a-z_]\w*", code) == [], f"{source}:{query.name}: a named parameter left"
    documented = set(re.findall(r"(?<![:\w]):([a-z_]\w*)", query.doc))
    assert documented == set(query.parameters), f"{source}:{query.name}: its comment documents {sorted(documented)}"


# --- call sites -------------------------------------------------------------------------------------------------

CALL_METHODS = {"fetch", "fetchrow", "fetchval", "execute"}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _query_files_named(path: Path, tree: ast.Module) -> dict[str, Queries]:
    """The names under which the module at ``path`` holds a query file (imported or its own)."""
    named: dict[str, Queries] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                value = getattr(module, alias.name, None)
                if isinstance(value, Queries):
                    named[alias.asname or alias.name] = value
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id == "Queries":
                module = importlib.import_module(_module_name(path))
                for target in node.targets:
                    assert isinstance(target, ast.Name)
                    named[target.id] = getattr(module, target.id)
    return named


def _call_sites() -> list[tuple[str, Queries, str, ast.Call]]:
    """Every ``<file>.<query>.<fetch|fetchrow|fetchval|execute>(...)`` of streams/ and streams_harness/."""
    sites = []
    for path in sorted([*ROOT.glob("streams/**/*.py"), *ROOT.glob("streams_harness/**/*.py")]):
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        named = _query_files_named(path, tree)
        if not named:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            query_ref = node.func.value
            if (
                node.func.attr in CALL_METHODS
                and isinstance(query_ref, ast.Attribute)
                and isinstance(query_ref.value, ast.Name)
                and query_ref.value.id in named
            ):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                sites.append((where, named[query_ref.value.id], query_ref.attr, node))
    return sites


SITES = _call_sites()


def test_call_sites_found() -> None:
    assert len(SITES) + len(DECLARED) >= 60
    assert any(where.startswith("streams/ledger/store.py") for where, *_ in SITES)
    assert any(where.startswith("streams_harness/bench/floor.py") for where, *_ in SITES)


@pytest.mark.parametrize(("where", "queries", "name", "call"), SITES, ids=[s[0] for s in SITES])
def test_call_site_names_exactly_the_parameters_of_an_existing_query(
    where: str, queries: Queries, name: str, call: ast.Call
) -> None:
    assert name in queries.names(), f"{where}: no query {name!r} in {queries.filename}"
    query = getattr(queries, name)
    assert len(call.args) == 1 and not isinstance(call.args[0], ast.Starred), f"{where}: only the pool/connection"
    given = [k.arg for k in call.keywords if k.arg is not None]  # k.arg is None for a **mapping
    by_name = len(given) == len(call.keywords)
    assert by_name, f"{where}: parameters by name, not **mapping (so that this test can read them)"
    assert sorted(given) == sorted(query.parameters), f"{where}: {name} takes {sorted(query.parameters)}"


#: The batched statements are declared, not called by name: their declaration checks their parameters.
DECLARED = [(f"streams/ledger/store.py:BATCHED[{s.name}]", s.query) for s in BATCHED]


def test_a_batched_statement_whose_columns_miss_a_parameter_is_refused_when_declared() -> None:
    with pytest.raises(ValueError, match=r"batched statement t: columns \('operation_ids',\) do not match"):
        BatchedStatement("t", LEDGER.claim_for_submit, ("operation_ids",), lambda rows, batch: [])
    with pytest.raises(ValueError, match="do not match"):  # a name the query does not take
        BatchedStatement("t", LEDGER.claim_for_submit, ("operation_ids", "claim_ids", "nope"), lambda r, b: [])


@pytest.mark.parametrize(("source", "query"), ALL_QUERIES, ids=[f"{s}:{q.name}" for s, q in ALL_QUERIES])
def test_every_query_is_called_with_all_its_parameters(source: str, query: Query) -> None:
    called = [
        where
        for where, queries, name, _ in SITES
        if (query_path(queries.package, queries.filename), name) == (query.source, query.name)
    ] + [where for where, declared in DECLARED if (declared.source, declared.name) == (query.source, query.name)]
    assert called, f"{source}:{query.name} is called nowhere in streams/ or streams_harness/"


#: A named parameter left in a compiled statement: aiosql numbers ``:name`` outside quotes, and takes a quote in a
#: ``--`` comment (an apostrophe) for the start of a string, so the parameters after it stay ``:name`` (PostgreSQL:
#: syntax error at or near ":"). ``::type`` casts are not parameters.
LEFT_AS_NAME = re.compile(r"(?<![:\w]):[A-Za-z_]\w*")


@pytest.mark.parametrize(("source", "query"), ALL_QUERIES, ids=[f"{s}:{q.name}" for s, q in ALL_QUERIES])
def test_every_named_parameter_is_numbered(source: str, query: Query) -> None:
    without_strings = re.sub(r"'(?:[^']|'')*'", "''", "\n".join(line.split("--")[0] for line in query.sql.splitlines()))
    assert LEFT_AS_NAME.findall(without_strings) == [], f"{source}:{query.name}: an apostrophe in a comment?"
