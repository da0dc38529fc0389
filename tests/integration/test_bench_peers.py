"""The benchmark's job-queue peer (procrastinate) runs a tiny round against the real services and the bench's own
simulator, and reports which of the product's promises it keeps, beside the services' CPU per operation."""

from __future__ import annotations

import io

import asyncpg
import pytest

from streams.config import Settings
from streams_harness.bench.runner import PROCRASTINATE, Bench, BenchOptions

pytestmark = pytest.mark.integration


async def test_the_procrastinate_peer_runs_a_round_and_reports_its_promises(
    migrated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in migrated.to_env().items():
        monkeypatch.setenv(name, value)
    opts = BenchOptions(
        operations=20,
        workers=(),
        partitions=(2,),
        naive=False,
        floor=False,
        naive_processes=1,
        profile=False,
        paced_rate_per_s=0,
        run_timeout_s=120,
    )
    out = io.StringIO()
    bench = Bench(opts, out)
    records = await bench.run()

    assert [(r["kind"], r["label"], r["timed_out"]) for r in records] == [
        (PROCRASTINATE, "procrastinate x1 p2 aiohttp", False)
    ], out.getvalue()
    record = records[0]
    assert record["operations_final"] == 20
    assert record["posts_per_operation"] == 1.0
    assert record["max_jobs_per_operation"] == 1
    assert record["max_gets_in_flight_per_job"] == 1
    assert record["output_duplicates"] == 0
    assert record["kafka_messages_by_topic"]["outputs_delivered"] == 20  # each output published once
    # it records no charges: the only promise of the product's it breaks in a run without faults
    assert [p.split("=")[0] for p in record["broken_promises"]] == [
        "charges recorded minus the provider's for the jobs seen ending"
    ]
    assert record["postgres_round_trips_per_operation"] > 0
    assert record["postgres_backends_cpu_ms_per_operation"] > 0
    assert record["kafka_broker_cpu_ms_per_operation"] is not None

    # its procrastinate database removed with the run's ledger database
    conn = await asyncpg.connect(migrated.database_url.get_secret_value())
    try:
        left = await conn.fetchval("SELECT count(*) FROM pg_database WHERE datname LIKE $1", f"%{record['run_id']}%")
    finally:
        await conn.close()
    assert left == 0
