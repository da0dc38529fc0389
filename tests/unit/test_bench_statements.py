"""The benchmark's statement profile (pg_stat_statements): naming PostgreSQL's texts by the project's queries, the
per-operation figures between two readings, and their table."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from streams.ledger.sql import LEDGER, parse_queries
from streams_harness.bench.statements import (
    LISTED_STATEMENTS,
    Reading,
    Statement,
    changed_between,
    known_queries,
    query_files,
    render_statements,
    statement_figures,
    statement_name,
    statement_shape,
)

ROOT = Path(__file__).resolve().parents[2]

#: PostgreSQL's texts of three queries as pg_stat_statements showed them (their constants as parameters: a
#: boolean, a NULL value, extract's field), and of statements no .sql file holds.
SEEN = {
    "SELECT set_config($3, $4, $5) IS NOT NULL AND x.n = $1 AND y IS NULL": (
        "SELECT set_config(:a, :b, true) IS NOT NULL AND x.n = :c AND y IS NULL"
    ),
    "SELECT CASE WHEN r.s IS NOT NULL THEN $2 ELSE $1 END": "SELECT CASE WHEN r.s IS NOT NULL THEN NULL ELSE :a END",
    "SELECT floor(extract($1 FROM t.at) * $2)::bigint FROM t": (
        "SELECT floor(extract(epoch FROM t.at) * 1000)::bigint FROM t"
    ),
    # a string continued on the next line is one constant; a comment's apostrophe opens no string; a unary minus
    # goes with its constant; prefixed strings and exponents are constants too
    "SELECT $1 || x, $2 -- the row's text\nFROM t WHERE n = $3 AND m > $4 - y AND e = $5 AND f = $6": (
        "SELECT 'one, '\n       'continued' || x, :a -- the row's text\nFROM t WHERE n = -1 AND m > 2.5e3 - y "
        "AND e = E'\\n' AND f = .5"
    ),
}


def test_a_query_reads_the_same_as_postgres_shows_it() -> None:
    for shown, ours in SEEN.items():
        query = parse_queries(f"-- name: q\n{ours};\n")["q"]
        assert statement_shape(shown) == statement_shape(query.sql), (shown, query.sql)
    # a value in a name, a cast or a qualified column is not one
    assert statement_shape("SELECT x1, t.col2, $1::int4[]  FROM t2;") == "SELECT x1, t.col2, ?::int4[] FROM t2"


def test_every_query_file_is_read_and_no_two_queries_read_alike() -> None:
    """Every ``queries/*.sql`` file of the repository names statements, and every named query's shape is its own:
    a statement is never charged to another query's name."""
    names = known_queries()
    assert names[statement_shape(LEDGER.claim_for_submit.sql)] == "ledger.sql:claim_for_submit"
    on_disk = sorted(
        p.name for package in ("streams", "streams_harness") for p in (ROOT / package).rglob("queries/*.sql")
    )
    files = query_files()
    assert sorted(f.filename for f in files) == on_disk
    assert {"databases.sql", "snapshot.sql", "ledger.sql", "bench.sql"} <= set(on_disk)
    # as many shapes as queries (a collision would drop one)
    assert len(names) == sum(len(f.names()) for f in files)


def test_a_statement_no_file_holds_is_named_by_its_text_cut_short_with_its_values_blanked() -> None:
    assert statement_name("COMMIT", {}) == "COMMIT"
    # PostgreSQL does not normalize a utility statement: its values are blanked all the same
    assert statement_name("SET application_name = 'x'", {}) == "SET application_name = ?"
    assert statement_name("ALTER ROLE r PASSWORD 'hunter2'", {}) == "ALTER ROLE r PASSWORD ?"
    assert statement_name("WITH RECURSIVE typeinfo_tree(\n oid, ns) AS (SELECT 1)", {}) == "asyncpg:type_introspection"
    long = "SELECT   " + ", ".join(f"c{i}" for i in range(40)) + " FROM t WHERE a = $1"
    name = statement_name(long, {})
    assert len(name) == 60 and name.startswith("SELECT c0, c1") and name.endswith("...")


def test_the_figures_are_the_differences_per_operation_ranked_by_time() -> None:
    before = {1: Statement("ledger.sql:a", 10, 5.0, 10), 2: Statement("BEGIN", 4, 0.1, 0)}
    after = {
        1: Statement("ledger.sql:a", 30, 25.0, 50),  # +20 calls, +20 ms, +40 rows
        2: Statement("BEGIN", 4, 0.1, 0),  # not run in between: left out
        3: Statement("ledger.sql:b", 5, 40.0, 5),  # new: all of it
        4: Statement("ledger.sql:b", 5, 10.0, 5),  # the same name (another text): summed
    }
    figures = statement_figures(before, after, operations=10)
    assert figures["postgres_statements_per_operation"] == 3.0
    assert figures["postgres_exec_ms_per_operation"] == 7.0
    assert figures["postgres_statements"] == [
        {
            "statement": "ledger.sql:b",
            "calls_per_operation": 1.0,
            "exec_ms_per_operation": 5.0,
            "exec_ms_per_call": 5.0,
            "rows_per_call": 1.0,
        },
        {
            "statement": "ledger.sql:a",
            "calls_per_operation": 2.0,
            "exec_ms_per_operation": 2.0,
            "exec_ms_per_call": 1.0,
            "rows_per_call": 2.0,
        },
    ]
    # an entry with fewer calls than before was evicted and made anew: it counts whole
    anew = statement_figures({1: Statement("x", 50, 9.0, 50)}, {1: Statement("x", 2, 1.0, 2)}, operations=1)
    assert anew["postgres_statements_per_operation"] == 2.0
    many = {i: Statement(f"s{i}", 1, float(i), 1) for i in range(LISTED_STATEMENTS + 3)}
    listed = statement_figures({}, many, operations=1)["postgres_statements"]
    assert isinstance(listed, list) and len(listed) == LISTED_STATEMENTS
    assert listed[0]["statement"] == f"s{LISTED_STATEMENTS + 2}"


def test_the_table_shows_each_configuration_once_and_skips_runs_without_a_profile() -> None:
    figures = statement_figures({}, {1: Statement("ledger.sql:a", 20, 10.0, 20)}, operations=10)
    records: list[dict[str, object]] = [
        {"label": "floor", "postgres_statements": None},
        {"label": "pipeline w1 p4 aiohttp", **figures},
        {"label": "pipeline w1 p4 aiohttp", **figures},  # a repeat
    ]
    lines = render_statements(records).splitlines()
    assert lines[0].startswith("PostgreSQL statements")
    assert [line.split()[0] for line in lines[2:]] == ["pipeline", "ledger.sql:a"]
    assert lines[3].split()[1:] == ["2.000", "1.0000", "0.500"]
    assert render_statements([{"label": "floor", "postgres_statements": None}]) == ""


def test_a_reset_or_an_eviction_between_readings_voids_the_difference() -> None:
    at = datetime(2026, 12, 4, tzinfo=UTC)
    before = Reading({}, dealloc=3, stats_reset=at)
    assert changed_between(before, Reading({}, dealloc=3, stats_reset=at)) is None
    evicted = changed_between(before, Reading({}, dealloc=5, stats_reset=at))
    assert evicted is not None and "evicted" in evicted and "2 times" in evicted
    reset = changed_between(before, Reading({}, dealloc=0, stats_reset=datetime(2026, 12, 5, tzinfo=UTC)))
    assert reset is not None and "reset" in reset
