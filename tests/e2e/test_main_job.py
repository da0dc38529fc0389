"""End to end: the simulator with faults on and two real worker processes (honcho, Procfile) replaying
a few hundred rows of the real trace, plus bad input published to the real topics."""

from __future__ import annotations

import base64
import io
import uuid
from pathlib import Path

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaProducer

from streams.clients.follow import read_topic_to_end
from streams.config import Settings
from streams.setup.admin import create_topics, delete_topics, migrate
from streams_harness.mainjob import MainJobOptions, run_main_job
from streams_harness.report import broken_promises

pytestmark = pytest.mark.e2e

FAULTS = {
    "fault_429": 0.03,
    "fault_502_job_id": 0.03,
    "fault_5xx": 0.02,
    "fault_drop_after_create": 0.02,
    "fault_slow": 0.01,
    "fault_job_failed": 0.02,
}


async def publish_bad_input(settings: Settings, tag: str) -> dict[str, tuple[str, bytes]]:
    """Bad values on the real topics; returns key -> (expected reason, original bytes)."""
    bad = {
        f"{tag}-nonjson": ("submissions", b"{not json", "not_json"),
        f"{tag}-missing": ("submissions", orjson.dumps({"operation_id": f"{tag}-missing"}), "schema"),
        f"{tag}-wrongtype": (
            "submissions",
            orjson.dumps(
                {
                    "operation_id": f"{tag}-wrongtype",
                    "submitted_at_ms": 1,
                    "request": {"model": 3, "input": {"prompt": "hi", "max_tokens": 3}},
                }
            ),
            "schema",
        ),
        f"{tag}-oversized": ("submissions", b'{"pad": "' + b"x" * (settings.max_value_bytes + 10) + b'"}', "oversized"),
        f"{tag}-ghostpoll": (
            "polls",
            orjson.dumps(
                {"operation_id": f"{tag}-ghost", "remote_job_id": "job-ghost", "poll_claim_id": 1, "claimed_at_ms": 1}
            ),
            "unknown_operation",
        ),
    }
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, max_request_size=2_000_000)
    await producer.start()
    try:
        for key, (role, value, _) in bad.items():
            await producer.send_and_wait(settings.topic(role), value, key=key.encode())
    finally:
        await producer.stop()
    return {key: (reason, value) for key, (_, value, reason) in bad.items()}


async def test_trace_through_two_workers_with_faults(
    base_settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:6]
    settings = base_settings.replace(topic_prefix=f"e2e-{run}.", app_id=f"streams-e2e-{run}")
    for key, value in {
        "STREAMS_DATABASE_URL": settings.database_url.get_secret_value(),
        "STREAMS_TOPIC_PREFIX": settings.topic_prefix,
        "STREAMS_APP_ID": settings.app_id,
        "STREAMS_HTTP_READ_TIMEOUT_S": "3",
        "STREAMS_LEASE_TTL_MS": "5000",
        "STREAMS_REMOTE_CALL_DEADLINE_S": "3",
        "STREAMS_LEASE_MARGIN_S": "1",
        "STREAMS_VISIBILITY_TIMEOUT_S": "8",
    }.items():
        monkeypatch.setenv(key, value)
    migrate(settings.database_url.get_secret_value())
    await create_topics(settings.replace(partitions=4))
    expected_letters = await publish_bad_input(settings, f"bad{run}")

    out = io.StringIO()
    report = await run_main_job(
        MainJobOptions(
            rows=300,
            compression=30.0,
            workers=2,
            partitions=4,
            seed=11,
            faults=FAULTS,
            report_path=tmp_path / "report.json",
            timeout_s=300,
            isolate=False,
        ),
        out=out,
    )
    assert (tmp_path / "report.json").exists()
    assert report["operations_submitted"] == 300
    assert report["operations_missing"] == 0
    assert report["operations_final"] == 300, out.getvalue()[-3000:]
    assert report["max_jobs_per_operation"] == 1
    assert report["max_gets_in_flight_per_job"] == 1
    assert report["output_duplicates"] == 0
    assert report["outputs_undelivered"] == 0
    assert report["output_events"] == report["outputs_expected"] > 0
    assert set(report["operations_by_state"]) <= {
        "succeeded",
        "failed",
        "canceled",
        "uncertain",
        "rejected",
        "stalled",
    }
    assert report["operations_by_state"]["stalled"] == 0  # no GET-side fault in this run
    assert report["operations_by_state"]["succeeded"] > 200
    assert sum(report["faults_injected"].values()) > 0
    # 5% canceled by default, some before their POST, some while running; none of their outputs delivered
    cancels = report["cancellations"]
    assert cancels["asked"] == 15
    assert cancels["canceled"] > 0 and cancels["canceled_before_post"] > 0
    assert cancels["canceled"] + cancels["succeeded_first"] + cancels["other"] == 15
    assert sum(n for state, n in cancels["asked_when"].items() if state in ("submitted", "queued", "running")) > 0
    assert report["operations_by_state"]["canceled"] == cancels["canceled"]
    assert report["canceled_outputs_delivered"] == 0
    # callbacks on by default, with lost, duplicated, reordered and badly signed deliveries
    callbacks = report["callbacks"]
    assert callbacks["received"] > 0 and callbacks["made_due"] > 0
    assert callbacks["lost"] > 0 and callbacks["bad_signature"] > 0
    assert callbacks["refused_401"] > 0
    assert callbacks["refused_by_reason"].get("bad_signature", 0) == callbacks["refused_401"]
    assert broken_promises(report, repeats_allowed=False) == [], out.getvalue()[-3000:]

    pool = await asyncpg.create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=2)
    try:
        run_id = report["run_id"]
        rows = await pool.fetch(
            "SELECT state::text AS state, reason FROM operations WHERE operation_id LIKE $1 AND state = 'uncertain'",
            f"{run_id}-%",
        )
        assert all(r["reason"] for r in rows)
        posts = await pool.fetchval(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM remote_calls WHERE method='POST' AND operation_id LIKE $1"
            " AND outcome IN ('created', 'created_via_502', 'unknown_outcome') GROUP BY operation_id) c",
            f"{run_id}-%",
        )
        assert posts == 1  # no operation was sent twice
    finally:
        await pool.close()

    letters = {}
    for r in await read_topic_to_end(settings, "dead_letter"):
        key = base64.b64decode(r.value["key_base64"] or "").decode()
        letters[key] = r.value
    for key, (reason, original) in expected_letters.items():
        assert key in letters, f"{key} not dead-lettered"
        assert letters[key]["reason"] == reason
        assert base64.b64decode(letters[key]["original_base64"]) == original
    await delete_topics(settings)


async def test_lookup_on_reconciles_every_uncertain_operation_whose_job_exists(tmp_path: Path) -> None:
    """The main job with lookup on and many unknown POST outcomes: every operation whose job the provider
    created is adopted and observed; the others stay uncertain, "not found by lookup"; nothing is POSTed twice."""
    out = io.StringIO()
    report = await run_main_job(
        MainJobOptions(
            rows=200,
            compression=30.0,
            workers=2,
            partitions=4,
            seed=5,
            faults={"fault_5xx": 0.08, "fault_drop_after_create": 0.05, "fault_job_failed": 0.05},
            report_path=tmp_path / "report.json",
            timeout_s=300,
            lookup=True,
        ),
        out=out,
    )
    assert report["operations_final"] == 200, out.getvalue()[-3000:]
    assert report["uncertain_with_provider_job"] == 0
    assert report["reconciled"]["automatic"] > 0
    assert set(report["uncertain_reasons"]) <= {"not_found_by_lookup"}
    assert report["max_jobs_per_operation"] == 1 and report["orphan_jobs"] == 0
    assert report["outputs_undelivered"] == 0 and report["state_regressions"] == 0
    assert report["charges_total"]["provider"] == report["charges_total"]["recorded"]
    assert report["refunds"]["provider"] == report["refunds"]["recorded"] > 0


async def test_a_short_run_against_the_second_dialect_keeps_every_promise(tmp_path: Path) -> None:
    """The main job against replicate-predictions (statuses starting|processing|..., outputs as plain values), with
    its default faults, cancellations and callbacks: every zero held. Lookup stays off (the main job's default)."""
    out = io.StringIO()
    report = await run_main_job(
        MainJobOptions(
            rows=40,
            compression=30.0,
            workers=2,
            partitions=4,
            seed=3,
            dialect="replicate-predictions",
            cancel_fraction=0.1,
            report_path=tmp_path / "report.json",
            timeout_s=300,
        ),
        out=out,
    )
    assert report["dialect"] == "replicate-predictions"
    assert report["operations_final"] == 40, out.getvalue()[-3000:]
    assert broken_promises(report, repeats_allowed=False) == [], out.getvalue()[-3000:]
    assert report["operations_by_state"]["succeeded"] > 20
    assert report["cancellations"]["asked"] == 4 and report["canceled_outputs_delivered"] == 0
    assert report["callbacks"]["received"] > 0
