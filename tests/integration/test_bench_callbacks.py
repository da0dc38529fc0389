"""The benchmark's callbacks comparison runs a tiny round against the real services and the bench's own
simulator: one worker on jobs lasting several poll intervals, completion callbacks off and then on."""

from __future__ import annotations

import io
import re

import pytest

from streams.config import Settings
from streams_harness.bench.runner import CALLBACKS, Bench, BenchOptions, callbacks_comparison, summarize_runs
from streams_harness.bench.statements import LIBRARY_STATEMENTS, known_queries

pytestmark = pytest.mark.integration

OPERATIONS = 20

#: Every name a statement of the project's or of asyncpg's gets in the statement profile.
NAMED = set(known_queries().values()) | set(LIBRARY_STATEMENTS.values())

#: The ledger's tables: a statement naming one is the project's.
LEDGER_TABLES = re.compile(r"\b(operations|outbox|outputs|transitions|remote_calls|remote_jobs|cancellations)\b")


async def test_callbacks_save_the_gets_of_long_jobs_and_every_one_sent_is_received(
    migrated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in migrated.to_env().items():
        monkeypatch.setenv(name, value)
    opts = BenchOptions(
        workers=(),
        partitions=(2,),
        naive=False,
        procrastinate=False,
        floor=False,
        profile=False,
        paced_rate_per_s=0,
        callbacks_comparison=True,
        callbacks_operations=OPERATIONS,
        callbacks_rate_per_s=20.0,
        callbacks_job_duration_ms=1000.0,
        callbacks_poll_interval_ms=200,
        run_timeout_s=120,
    )
    out = io.StringIO()
    records = await Bench(opts, out).run()

    assert [(r["kind"], r["label"], r["callbacks_enabled"], r["timed_out"]) for r in records] == [
        (CALLBACKS, "callbacks off w1 p2", False, False),
        (CALLBACKS, "callbacks on w1 p2", True, False),
    ], out.getvalue()
    off, on = records
    for record in records:
        assert record["operations_final"] == OPERATIONS
        assert record["broken_promises"] == [], record["broken_promises"]
        assert record["max_gets_in_flight_per_job"] == 1
        assert record["completion_to_delivery_ms"]["p99"] is not None
        # its worker's listener read the notifications of its committed outputs (streams_ledger_notifications_total)
        assert record["postgres_notifications_per_operation"] > 0
        # PostgreSQL's statement profile (pg_stat_statements): the worker's writes named by their queries, a
        # claim and a save at least per operation, and no write of the product's left unnamed
        assert record["postgres_statements"] is not None, (
            "no statement profile: PostgreSQL must load pg_stat_statements (scripts/services restart postgres)"
        )
        listed = {s["statement"]: s for s in record["postgres_statements"]}
        assert listed["ledger.sql:claim_for_submit"]["calls_per_operation"] > 0, listed
        assert listed["ledger.sql:save_observation"]["calls_per_operation"] > 0, listed
        # neither the project's nor the client library's: none of them touches the ledger's tables
        unnamed = [name for name in listed if name not in NAMED]
        assert not [name for name in unnamed if LEDGER_TABLES.search(name)], unnamed
        assert record["postgres_exec_ms_per_operation"] > 0
        assert record["postgres_statements_per_operation"] >= 3.0  # accept, claim, save submitted, observe, ...
    # without callbacks a 1 s job is polled every 200 ms hint until it ends
    assert off["gets_per_completed_operation"] >= 3.0, off
    assert off["callbacks"] == {"sent": 0, "acknowledged": 0, "received": 0, "made_due": 0, "refused": 0}
    # with them: the first poll (the job still queued; none when it came after the end), then the one its
    # callback made due (and rarely one more, when the callback came during a GET)
    assert on["gets_per_completed_operation"] <= 2.1, on
    assert on["gets_per_completed_operation"] < off["gets_per_completed_operation"]
    assert on["callbacks"] == {
        "sent": OPERATIONS,
        "acknowledged": OPERATIONS,
        "received": OPERATIONS,
        "made_due": OPERATIONS,
        "refused": 0,
    }
    comparison = callbacks_comparison(summarize_runs(records), 1000.0, 200)
    assert comparison is not None
    assert comparison["gets_ratio_on_to_off"] == pytest.approx(2.0 / off["gets_per_completed_operation"], abs=0.01)
