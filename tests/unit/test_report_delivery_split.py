"""Completion to delivery split into the poll schedule's share and the pipeline's, from hand-made records."""

from __future__ import annotations

from typing import Any

from streams_harness.report import LedgerOperation, build_report, delivery_split


def sim_job(operation_id: str, completed_at: float, first_terminal_get_at: float | None) -> dict[str, Any]:
    return {
        "client_reference": operation_id,
        "job_id": f"job-{operation_id}",
        "status": "succeeded",
        "gets": 1,
        "max_gets_in_flight": 1,
        "created_at": completed_at,
        "completed_at": completed_at,
        "first_terminal_get_at": first_terminal_get_at,
    }


def delivered(operation_id: str, ts_ms: int) -> tuple[dict[str, Any], int]:
    value = {
        "operation_id": operation_id,
        "event_id": f"output:{operation_id}:0",
        "output_id": "0",
        "remote_job_id": f"job-{operation_id}",
    }
    return value, ts_ms


def test_each_delivered_output_splits_at_the_first_terminal_get() -> None:
    ids = ["a", "b", "c"]
    ledger = [LedgerOperation(i, "succeeded", None, 1_000, 2_000, 1, f"job-{i}") for i in ids]
    report = build_report(
        submitted_ids=ids,
        ledger=ledger,
        sim_jobs=[
            sim_job("a", 100.000, 100.060),  # seen 60 ms after completion, delivered 10 ms later
            sim_job("b", 100.000, 100.050),  # 50 + 30
            sim_job("c", 100.000, None),  # never answered terminal (e.g. a callback): in the total only
        ],
        delivered=[
            delivered("a", 100_070),
            delivered("a", 100_090),  # a duplicate event: counted once, by its first record
            delivered("b", 100_080),
            delivered("c", 100_200),
        ],
        meta={},
    )
    assert report["completion_to_delivery_ms"] == {"p50": 80.0, "p99": 197.6}
    split = report["completion_to_delivery_split_ms"]
    assert split["poll_schedule"] == {"p50": 55.0, "p99": 59.9}
    assert split["pipeline"] == {"p50": 20.0, "p99": 29.8}


def test_no_delivery_has_no_shares() -> None:
    assert delivery_split([], []) == {
        "poll_schedule": {"p50": None, "p99": None},
        "pipeline": {"p50": None, "p99": None},
    }
