"""The run report's GETs per completed operation by job length, counted in poll intervals."""

from __future__ import annotations

import pytest

from streams_harness.report import LedgerOperation, build_report, gets_by_job_length


def test_operations_fall_in_classes_of_poll_intervals_and_empty_classes_are_shown() -> None:
    # with 5 s intervals: 2 s and 4.9 s under one interval, 5 s and 14 s 1-3, 60 s >= 10; none 3-10
    split = gets_by_job_length([(1, 2.0), (2, 4.9), (2, 5.0), (4, 14.0), (13, 60.0)], 5.0)
    assert split == {
        "poll_interval_s": 5.0,
        "classes": {
            "<1": {"operations": 2, "gets_mean": 1.5},
            "1-3": {"operations": 2, "gets_mean": 3.0},
            "3-10": {"operations": 0, "gets_mean": None},
            ">=10": {"operations": 1, "gets_mean": 13.0},
        },
    }
    assert list(gets_by_job_length([], 1.0, edges=(2.0,))["classes"]) == ["<2", ">=2"]
    with pytest.raises(ValueError, match="poll_interval_s"):
        gets_by_job_length([(1, 1.0)], 0.0)


def job(operation_id: str, gets: int, created_at: float, completed_at: float, n: int = 1) -> dict[str, object]:
    return {
        "client_reference": operation_id,
        "job_id": f"job-{operation_id}-{n}",
        "status": "succeeded",
        "gets": gets,
        "max_gets_in_flight": 1,
        "created_at": created_at,
        "completed_at": completed_at,
        "charge_amount": "0",
    }


def test_the_report_splits_the_jobs_that_ran_to_their_end_by_their_saved_jobs_length() -> None:
    ledger = [
        LedgerOperation("short", "succeeded", None, 1_000, 2_000, 1, "job-short-1"),
        LedgerOperation("long", "failed", None, 1_000, 9_000, 0, "job-long-1"),
        # canceled: its job's scheduled end says nothing of how long it ran
        LedgerOperation("canceled", "canceled", None, 1_000, 3_000, 0, "job-canceled-1"),
        LedgerOperation("running", "submitted", None, 1_000, None, 0, "job-running-1"),
    ]
    sim_jobs = [
        job("short", 1, 100.0, 100.5),
        job("long", 5, 100.0, 112.0),
        job("long", 1, 100.0, 100.1, n=2),  # a duplicate creation: its GETs count, its length does not
        job("canceled", 2, 100.0, 160.0),
        job("running", 3, 100.0, 200.0),
    ]
    ids = [o.operation_id for o in ledger]
    report = build_report(
        submitted_ids=ids, ledger=ledger, sim_jobs=sim_jobs, delivered=[], meta={}, poll_interval_s=2.0
    )
    assert report["gets_per_completed_operation_by_job_length"]["classes"] == {
        "<1": {"operations": 1, "gets_mean": 1.0},
        "1-3": {"operations": 0, "gets_mean": None},
        "3-10": {"operations": 1, "gets_mean": 6.0},
        ">=10": {"operations": 0, "gets_mean": None},
    }
    plain = build_report(submitted_ids=ids, ledger=ledger, sim_jobs=sim_jobs, delivered=[], meta={})
    assert "gets_per_completed_operation_by_job_length" not in plain
