"""The run report's reconciliation and accounting figures, from hand-made independent records."""

from __future__ import annotations

from typing import Any

from streams.model.codes import ReasonCode
from streams_harness.report import LedgerAccounting, LedgerOperation, broken_promises, build_report


def op(
    operation_id: str, state: str, reason_code: ReasonCode | None = None, job_id: str | None = None
) -> LedgerOperation:
    outputs = 1 if state == "succeeded" else 0
    return LedgerOperation(operation_id, state, reason_code, 1_000, 2_000, outputs, job_id)


def job(operation_id: str, status: str, gets: int, charge: str = "0.5", **extra: Any) -> dict[str, Any]:
    record = {
        "client_reference": operation_id,
        "job_id": f"job-{operation_id}-{gets}",
        "status": status,
        "gets": gets,
        "max_gets_in_flight": 1,
        "completed_at": 1.5,
        "charge_amount": charge,
        "refund_id": f"rf-{operation_id}" if status == "failed" else None,
    }
    record.update(extra)
    return record


def report(lookup: bool) -> dict[str, Any]:
    ledger = [
        op("a", "succeeded", job_id="job-a-2"),
        op("b", "failed", job_id="job-b-3"),
        op("c", "stalled", ReasonCode.UNKNOWN_STATUS, job_id="job-c-5"),
        op("d", "stalled", ReasonCode.JOB_NOT_FOUND, job_id="job-d-9"),
        op("e", "uncertain", ReasonCode.NOT_FOUND_BY_LOOKUP),
        op("f", "uncertain", ReasonCode.UNKNOWN_OUTCOME),
        op("g", "succeeded", job_id="job-g-2"),
    ]
    sim_jobs = [
        job("a", "succeeded", 2),
        job("b", "failed", 3, charge="0.25"),
        job("c", "succeeded", 5),  # the provider finished it; the client never understood its status
        job("d", "running", 9),
        job("f", "succeeded", 0),  # created by the POST whose outcome was unknown
        job("g", "succeeded", 2),
        job("g", "succeeded", 0, charge="0.125"),  # a duplicate creation
    ]
    accounting = LedgerAccounting(
        reconciled={"automatic": 1, "by_person": 2, "late_answer": 0},
        duplicate_creations=1,
        charges=[{"currency": "USD", "amount": "1.250", "jobs": 3}],
        refunds_settled=[{"currency": "USD", "amount": "0.25", "refunds": 1}],
        refunds_pending=0,
    )
    return build_report(
        submitted_ids=[o.operation_id for o in ledger],
        ledger=ledger,
        sim_jobs=sim_jobs,
        delivered=[],
        meta={"lookup": lookup},
        accounting=accounting,
    )


def test_reconciliation_and_accounting_figures() -> None:
    r = report(lookup=False)
    assert r["operations_by_state"] == {"failed": 1, "stalled": 2, "succeeded": 2, "uncertain": 2}
    assert r["stalled_reasons"] == {"unknown_status": 1, "job_not_found": 1}
    assert r["uncertain_reasons"] == {"not_found_by_lookup": 1, "unknown_outcome": 1}
    assert r["uncertain_with_provider_job"] == 1  # f: its job exists at the provider
    assert r["reconciled"] == {"automatic": 1, "by_person": 2, "late_answer": 0}
    assert r["duplicate_creations"] == {"provider": 1, "recorded": 1}
    # provider: every job that ended (a, b, c, f, g twice); recorded: what the ledger's accounting learned;
    # provider_seen_ending: the jobs whose end the ledger saw (a, b, g's first): c stalled, f uncertain, g's second
    # a duplicate nobody polled
    assert r["charges_total"] == {"provider": "2.375", "recorded": "1.25", "provider_seen_ending": "1.25"}
    assert r["refunds"] == {"provider": 1, "recorded": 1, "pending": 0}
    assert r["gets_spent_on_stuck_operations"] == {"operations": 2, "total": 14, "max": 9}


def test_zero_states_are_shown_and_lookup_makes_uncertain_with_a_job_a_broken_promise() -> None:
    r = build_report(submitted_ids=[], ledger=[], sim_jobs=[], delivered=[], meta={"lookup": True})
    assert r["operations_by_state"] == {"stalled": 0, "uncertain": 0}
    assert r["charges_total"] == {"provider": "0", "recorded": "0", "provider_seen_ending": "0"}
    assert "uncertain with a job the provider created (lookup on)=1" in broken_promises(
        report(lookup=True), repeats_allowed=True
    )
    assert not any("uncertain with a job" in p for p in broken_promises(report(lookup=False), repeats_allowed=True))


def test_a_charge_recorded_unlike_the_providers_is_a_broken_promise() -> None:
    r = report(lookup=False)
    before = broken_promises(r, repeats_allowed=True)  # the fixture's duplicate job and undelivered outputs
    assert not any("charges" in p for p in before)
    r["charges_total"]["recorded"] = "1.125"  # one charge of a job seen ending not recorded (or recorded wrong)
    after = broken_promises(r, repeats_allowed=True)
    assert [p for p in after if p not in before] == [
        "charges recorded minus the provider's for the jobs seen ending=-0.125"
    ]


def test_charges_are_compared_only_when_the_dialect_declares_them() -> None:
    r = report(lookup=False)
    r["charges_total"]["recorded"] = "0"  # the prediction API's answers carry no charge: none recorded
    seed = broken_promises({**r, "dialect": "seed-generations"}, repeats_allowed=True)
    predictions = broken_promises({**r, "dialect": "replicate-predictions"}, repeats_allowed=True)
    assert "charges recorded minus the provider's for the jobs seen ending=-1.25" in seed
    assert [p for p in seed if "charges" not in p] == predictions
