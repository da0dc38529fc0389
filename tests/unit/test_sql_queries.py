"""Named SQL queries: the parser and a sanity check of the ledger's queries."""

from __future__ import annotations

import re

import pytest

from streams.sql import LEDGER, Queries, parse_queries

TEXT = """\
-- A header comment before the first query is ignored.

-- name: first_query
-- $1 id
SELECT * FROM t WHERE id = $1;

--name:second
UPDATE t SET x = $2
WHERE id = $1;
-- name:   third_one
SELECT 1;
"""


def test_parse_names_and_bodies() -> None:
    queries = parse_queries(TEXT)
    assert list(queries) == ["first_query", "second", "third_one"]
    assert queries == {
        "first_query": "-- $1 id\nSELECT * FROM t WHERE id = $1;",
        "second": "UPDATE t SET x = $2\nWHERE id = $1;",
        "third_one": "SELECT 1;",
    }


def test_parse_without_names_is_empty() -> None:
    assert parse_queries("SELECT 1;\n-- just a comment\n") == {}
    assert parse_queries("") == {}


def test_name_must_be_alone_on_its_line() -> None:
    # "-- name: a b" is not a name line, so its text stays in the previous body.
    queries = parse_queries("-- name: a\nSELECT 1;\n-- name: b c\nSELECT 2;\n")
    assert queries == {"a": "SELECT 1;\n-- name: b c\nSELECT 2;"}


def test_duplicate_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="query 'a' is defined twice"):
        parse_queries("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")


@pytest.mark.parametrize(
    "text",
    ["-- name: a\n", "-- name: a\n\n   \n-- name: b\nSELECT 1;\n", "-- name: b\nSELECT 1;\n-- name: a\n  \n"],
)
def test_empty_query_is_an_error(text: str) -> None:
    with pytest.raises(ValueError, match="query 'a' is empty"):
        parse_queries(text)


EXPECTED_LEDGER = [
    "accept_operation",
    "claim_for_submit",
    "save_submitted",
    "save_submission_without_job",
    "reconcile_stale_submitting",
    "claim_due_polls",
    "get_operation",
    "claim_for_observe",
    "reschedule_poll",
    "save_observation",
    "save_stalled",
    "note_not_found",
    "note_unknown_status",
    "record_remote_call",
    "try_relay_lock",
    "lock_unpublished_outbox",
    "mark_outbox_published",
    "stale_accepted",
]

#: Number of parameters each query takes (from its documentation comment).
EXPECTED_ARITY = {
    "accept_operation": 6,
    "claim_for_submit": 3,
    "save_submitted": 7,
    "save_submission_without_job": 6,
    "reconcile_stale_submitting": 3,
    "claim_due_polls": 2,
    "get_operation": 1,
    "claim_for_observe": 4,
    "reschedule_poll": 4,
    "save_observation": 11,
    "save_stalled": 5,
    "note_not_found": 7,
    "note_unknown_status": 7,
    "record_remote_call": 9,
    "try_relay_lock": 0,
    "lock_unpublished_outbox": 1,
    "mark_outbox_published": 1,
    "stale_accepted": 2,
}


def test_ledger_names() -> None:
    assert LEDGER.names() == EXPECTED_LEDGER
    assert set(EXPECTED_ARITY) == set(EXPECTED_LEDGER)


def test_attribute_access() -> None:
    assert LEDGER.claim_for_submit.endswith("RETURNING req.i, o.fencing_token;")
    assert "UPDATE operations" in LEDGER.claim_for_submit
    with pytest.raises(AttributeError, match="no query named 'nope'"):
        _ = LEDGER.nope


def test_queries_loader_reads_the_same_file() -> None:
    assert Queries("ledger.sql").names() == EXPECTED_LEDGER


def _placeholders(sql: str) -> set[int]:
    code = re.sub(r"--[^\n]*", "", sql)  # comments document parameters; only the code counts
    return {int(n) for n in re.findall(r"\$(\d+)", code)}


@pytest.mark.parametrize("name", EXPECTED_LEDGER)
def test_placeholders_are_contiguous_from_one(name: str) -> None:
    used = _placeholders(getattr(LEDGER, name))
    assert used == set(range(1, len(used) + 1)), f"{name}: placeholders {sorted(used)}"
    assert len(used) == EXPECTED_ARITY[name]


def test_placeholder_helper() -> None:
    assert _placeholders("-- $9 doc\nSELECT $1, $2 -- $7\n, $10") == {1, 2, 10}


#: Named queries of the other files, with their number of parameters.
EXPECTED_OTHERS = {
    "operators.sql": {"adopt": 4, "abandon": 3, "repoll": 3, "fail_stalled": 3, "operation_holding_job": 1},
    "accounting.sql": {"accounting_summary": 1, "record_refund": 2},
    "reconcile.sql": {"claim_due_lookups": 4, "adopt_found_job": 7, "give_up_lookup": 4, "reschedule_lookup": 3},
}


@pytest.mark.parametrize("filename", sorted(EXPECTED_OTHERS))
def test_other_query_files(filename: str) -> None:
    queries = Queries(filename)
    assert queries.names() == list(EXPECTED_OTHERS[filename])
    for name, arity in EXPECTED_OTHERS[filename].items():
        used = _placeholders(getattr(queries, name))
        assert used == set(range(1, arity + 1)), f"{filename}:{name}: placeholders {sorted(used)}"
