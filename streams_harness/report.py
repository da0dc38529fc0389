"""The run report: every figure from an independent record, never from the pipeline's own counters.

* states: the PostgreSQL ledger;
* remote jobs, GETs, GETs in flight, remote completion times: the provider simulator's own record;
* output-delivered events: read back from the ``generation.outputs.delivered`` topic in Kafka.

Field names are shared by the main job, the soak and the benchmark.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from streams.ledger.sql import Queries
from streams.model.states import OperationState, can_transition
from streams.remote.dialect import DEFAULT_DIALECT, load_dialect

#: The report's named queries (``streams_harness/queries/report.sql``).
REPORT = Queries("report.sql", package="streams_harness")

#: States in which the pipeline is done with an operation: terminal, or waiting for the reconciler or a person.
FINAL_STATES = frozenset({"succeeded", "failed", "canceled", "rejected", "uncertain", "stalled"})
COMPLETED_STATES = frozenset({"succeeded", "failed", "canceled"})
#: Shown in ``operations_by_state`` even when zero.
ALWAYS_SHOWN_STATES = ("uncertain", "stalled")
TERMINAL_JOB_STATUSES = frozenset({"succeeded", "failed"})
#: Bounds of the job-length classes of :func:`gets_by_job_length`, in poll intervals: <1, 1-3, 3-10, >=10.
JOB_LENGTH_EDGES = (1.0, 3.0, 10.0)


@dataclass(frozen=True)
class LedgerAccounting:
    """What the ledger learned about remote jobs (the product's accounting, :meth:`Ledger.accounting_summary`,
    and the transition log), for the report's comparison with the provider's own record.

    ``reconciled`` maps ``automatic`` (adopted by lookup), ``by_person`` (adopted or abandoned by an operator)
    and ``late_answer`` (the same POST's answer arrived after ``uncertain``) to counts.
    """

    reconciled: Mapping[str, int]
    duplicate_creations: int
    charges: list[Mapping[str, Any]]
    refunds_settled: list[Mapping[str, Any]]
    refunds_pending: int


@dataclass(frozen=True)
class LedgerOperation:
    """One operation as the ledger holds it; ``reason_code`` is its :class:`streams.model.codes.ReasonCode` value (None
    when it has no reason), ``remote_job_id`` the job id saved on it (None: none)."""

    operation_id: str
    state: str
    reason_code: str | None
    accepted_at_ms: int
    final_at_ms: int | None
    outputs: int
    remote_job_id: str | None = None


def percentile(values: list[float], pct: float) -> float | None:
    """The ``pct`` percentile (0-100, inclusive method) of ``values``, or None when empty."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(pct) - 1] if pct < 100 else max(values)


def delivery_split(poll_shares_ms: list[float], pipeline_shares_ms: list[float]) -> dict[str, dict[str, float | None]]:
    """Completion to delivery in its two shares, ``p50`` and ``p99`` of each (ms, None when empty):
    ``poll_schedule`` (the job's completion at the provider to the first GET that answered it terminal, both from
    the simulator's record: the wait for the poll schedule) and ``pipeline`` (that answer to the output-delivered
    record's Kafka timestamp: the worker's own work). One value per delivered output in each list."""
    return {
        "poll_schedule": {
            "p50": _round(percentile(poll_shares_ms, 50)),
            "p99": _round(percentile(poll_shares_ms, 99)),
        },
        "pipeline": {
            "p50": _round(percentile(pipeline_shares_ms, 50)),
            "p99": _round(percentile(pipeline_shares_ms, 99)),
        },
    }


def gets_by_job_length(
    jobs: Iterable[tuple[int, float]], poll_interval_s: float, edges: tuple[float, ...] = JOB_LENGTH_EDGES
) -> dict[str, Any]:
    """GETs per completed operation by how long its remote job lasted, in poll intervals: ``jobs`` holds one
    ``(gets, job_length_s)`` per completed operation (the simulator's GETs of its jobs; creation to completion of
    its saved job, s), ``poll_interval_s`` the interval a job is measured in (> 0; the simulator's longest poll
    hint, ``poll_max_ms``), ``edges`` the increasing class bounds in intervals.

    Returns ``{"poll_interval_s": ..., "classes": {label: {"operations": n, "gets_mean": mean or None}}}``, the
    labels ``"<1"``, ``"1-3"``, ..., ``">=10"`` for the default edges, every class present even when empty.

    Raises:
        ValueError: ``poll_interval_s`` not positive.
    """
    if poll_interval_s <= 0:
        raise ValueError(f"poll_interval_s must be > 0, not {poll_interval_s}")
    labels = [f"<{edges[0]:g}"] + [f"{lo:g}-{hi:g}" for lo, hi in itertools.pairwise(edges)]
    labels.append(f">={edges[-1]:g}")
    gets: dict[str, list[int]] = {label: [] for label in labels}
    for n, length_s in jobs:
        index = sum(1 for edge in edges if length_s / poll_interval_s >= edge)
        gets[labels[index]].append(n)
    return {
        "poll_interval_s": poll_interval_s,
        "classes": {
            label: {"operations": len(v), "gets_mean": round(statistics.fmean(v), 3) if v else None}
            for label, v in gets.items()
        },
    }


def state_regressions(transitions: Iterable[tuple[str, str | None, str]]) -> int:
    """Count illegal steps in a transition log given as ``(operation_id, from_state, to_state)`` in order.

    A step is illegal when it is not a legal forward move (:func:`streams.model.states.can_transition`; the first
    step must be ``None -> accepted``) or when its ``from_state`` is not the previous step's ``to_state``.
    """
    bad = 0
    previous: dict[str, str] = {}
    for op, from_state, to_state in transitions:
        last = previous.get(op)
        if last is None:
            ok = from_state is None and to_state == "accepted"
        else:
            ok = from_state == last and can_transition(OperationState(last), OperationState(to_state))
        bad += not ok
        previous[op] = to_state
    return bad


def build_report(
    *,
    submitted_ids: Iterable[str],
    ledger: Iterable[LedgerOperation],
    sim_jobs: Iterable[Mapping[str, Any]],
    delivered: Iterable[tuple[Mapping[str, Any], int]],
    meta: Mapping[str, Any],
    transitions: Iterable[tuple[str, str | None, str]] = (),
    accounting: LedgerAccounting | None = None,
    cancel_asked: Iterable[str] = (),
    cancel_asked_when: Mapping[str, int] | None = None,
    poll_interval_s: float | None = None,
) -> dict[str, Any]:
    """Compute the report.

    Args:
        submitted_ids: operation ids this run published.
        ledger: the ledger's rows for those operations.
        sim_jobs: the simulator's job records (``client_reference``: the operation id; ``gets``, ``max_gets_in_flight``,
            ``completed_at`` and ``first_terminal_get_at`` in unix seconds).
        delivered: ``(value, kafka_timestamp_ms)`` of output-delivered records of this run.
        meta: ``workers``, ``partitions``, ``trace``, ``rows`` and anything else to carry into the report.
        transitions: the run's transition log, ``(operation_id, from_state, to_state)`` in order.
        accounting: what the ledger's accounting learned (compared with the simulator's record).
        cancel_asked: the operation ids the run asked to cancel (``cancellations`` and
            ``canceled_outputs_delivered``: :func:`cancellation_counts`), and ``cancel_asked_when`` the ledger's
            recorded cancellations by the state their operation was in when asked.
        poll_interval_s: given (> 0), the report has ``gets_per_completed_operation_by_job_length``
            (:func:`gets_by_job_length` over the operations that ended ``succeeded`` or ``failed``, a job's length
            from its saved job's ``created_at`` to ``completed_at``).

    Returns the report dict (the fields: docs/harness.md).
    """
    ids = set(submitted_ids)
    ops = {o.operation_id: o for o in ledger if o.operation_id in ids}
    transitions = list(transitions)
    delivered = list(delivered)
    by_state = Counter(o.state for o in ops.values())
    jobs_by_op: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    orphan_jobs = 0
    for job in sim_jobs:
        op = job.get("client_reference")
        if op in ids:
            jobs_by_op[str(op)].append(job)
            if op not in ops:  # a remote job for an operation the ledger does not hold
                orphan_jobs += 1
        elif op is None:
            orphan_jobs += 1
    completed = [o for o in ops.values() if o.state in COMPLETED_STATES]
    gets = [sum(int(j["gets"]) for j in jobs_by_op.get(o.operation_id, [])) for o in completed]
    completion_s = {
        (str(j["client_reference"]), str(j["job_id"])): float(j["completed_at"])
        for js in jobs_by_op.values()
        for j in js
    }
    seen_end_s = {
        (str(j["client_reference"]), str(j["job_id"])): float(j["first_terminal_get_at"])
        for js in jobs_by_op.values()
        for j in js
        if j.get("first_terminal_get_at") is not None
    }
    events = 0
    seen: set[str] = set()
    outputs_seen: set[tuple[str, str]] = set()
    latencies: list[float] = []
    poll_shares: list[float] = []
    pipeline_shares: list[float] = []
    for value, ts_ms in delivered:
        if value.get("operation_id") not in ids:
            continue
        events += 1
        if value["event_id"] in seen:
            continue
        seen.add(value["event_id"])
        outputs_seen.add((str(value["operation_id"]), str(value["output_id"])))
        job_key = (str(value["operation_id"]), str(value["remote_job_id"]))
        done = completion_s.get(job_key)
        if done is not None:
            latencies.append(ts_ms - done * 1000.0)
            seen_end = seen_end_s.get(job_key)
            if seen_end is not None:
                poll_shares.append(max(0.0, seen_end - done) * 1000.0)
                pipeline_shares.append(ts_ms - seen_end * 1000.0)
    outputs_expected = sum(o.outputs for o in ops.values() if o.state == "succeeded")
    final = [o for o in ops.values() if o.state in FINAL_STATES]
    span_s = 0.0
    if final:
        first = min(o.accepted_at_ms for o in ops.values())
        last = max(o.final_at_ms or o.accepted_at_ms for o in final)
        span_s = max(0.001, (last - first) / 1000.0)
    uncertain = Counter(o.reason_code or "unknown" for o in ops.values() if o.state == "uncertain")
    rejected = Counter(o.reason_code or "unknown" for o in ops.values() if o.state == "rejected")
    stalled = Counter(o.reason_code or "unknown" for o in ops.values() if o.state == "stalled")
    for state in ALWAYS_SHOWN_STATES:
        by_state.setdefault(state, 0)
    stuck_gets = [
        sum(int(j["gets"]) for j in jobs_by_op.get(o.operation_id, [])) for o in ops.values() if o.state == "stalled"
    ]
    provider_jobs = [j for js in jobs_by_op.values() for j in js]
    ended = [j for j in provider_jobs if j.get("status") in TERMINAL_JOB_STATUSES]
    # the jobs whose end the ledger saw: the saved job of an operation that completed (a GET answered terminal)
    seen_ending = {(o.operation_id, o.remote_job_id) for o in completed if o.remote_job_id is not None}
    ended_seen = [j for j in ended if (j.get("client_reference"), j.get("job_id")) in seen_ending]
    acc = accounting or LedgerAccounting({}, 0, [], [], 0)
    report: dict[str, Any] = {
        "operations_submitted": len(ids),
        "operations_in_ledger": len(ops),
        "operations_missing": len(ids) - len(ops),
        "operations_final": len(final),
        "operations_by_state": dict(sorted(by_state.items())),
        "uncertain_reasons": dict(uncertain),
        "rejected_reasons": dict(rejected),
        "stalled_reasons": dict(stalled),
        "uncertain_with_provider_job": sum(
            1 for o in ops.values() if o.state == "uncertain" and jobs_by_op.get(o.operation_id)
        ),
        "reconciled": {k: int(acc.reconciled.get(k, 0)) for k in ("automatic", "by_person", "late_answer")},
        "duplicate_creations": {
            "provider": sum(max(0, len(js) - 1) for js in jobs_by_op.values()),
            "recorded": acc.duplicate_creations,
        },
        "charges_total": {
            "provider": _decimal_text(sum((_decimal(j.get("charge_amount")) for j in ended), Decimal(0))),
            "recorded": _decimal_text(sum((_decimal(c.get("amount")) for c in acc.charges), Decimal(0))),
            "provider_seen_ending": _decimal_text(
                sum((_decimal(j.get("charge_amount")) for j in ended_seen), Decimal(0))
            ),
        },
        "refunds": {
            "provider": sum(1 for j in ended if j.get("status") == "failed" and j.get("refund_id")),
            "recorded": sum(int(r.get("refunds", 0)) for r in acc.refunds_settled),
            "pending": acc.refunds_pending,
        },
        "gets_spent_on_stuck_operations": {
            "operations": len(stuck_gets),
            "total": sum(stuck_gets),
            "max": max(stuck_gets, default=0),
        },
        "max_jobs_per_operation": max((len(js) for js in jobs_by_op.values()), default=0),
        "orphan_jobs": orphan_jobs,
        "max_gets_in_flight_per_job": max(
            (int(j["max_gets_in_flight"]) for js in jobs_by_op.values() for j in js), default=0
        ),
        "gets_per_completed_operation": {
            "mean": round(statistics.fmean(gets), 3) if gets else None,
            "max": max(gets, default=None),
        },
        "output_events": events,
        "output_duplicates": events - len(seen),
        "output_duplicates_after_dedupe": len(seen) - len(outputs_seen),
        "outputs_expected": outputs_expected,
        "outputs_undelivered": outputs_expected - len(outputs_seen),
        "state_regressions": state_regressions(transitions),
        **cancellation_counts(
            cancel_asked, ops.values(), transitions, (value for value, _ in delivered), cancel_asked_when
        ),
        "throughput_ops_per_s": round(len(final) / span_s, 2) if span_s else 0.0,
        "completion_to_delivery_ms": {
            "p50": _round(percentile(latencies, 50)),
            "p99": _round(percentile(latencies, 99)),
        },
        "completion_to_delivery_split_ms": delivery_split(poll_shares, pipeline_shares),
    }
    if poll_interval_s is not None:
        lengths = {
            (str(j["client_reference"]), str(j["job_id"])): float(j["completed_at"]) - float(j["created_at"])
            for js in jobs_by_op.values()
            for j in js
        }
        report["gets_per_completed_operation_by_job_length"] = gets_by_job_length(
            (
                (n, lengths[(o.operation_id, str(o.remote_job_id))])
                for o, n in zip(completed, gets, strict=True)
                if o.state in TERMINAL_JOB_STATUSES and (o.operation_id, str(o.remote_job_id)) in lengths
            ),
            poll_interval_s,
        )
    report.update(meta)
    return report


def cancellation_counts(
    asked: Iterable[str],
    ledger: Iterable[LedgerOperation],
    transitions: Iterable[tuple[str, str | None, str]],
    delivered: Iterable[Mapping[str, Any]],
    asked_when: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The report's ``cancellations`` and ``canceled_outputs_delivered`` (docs/cancellation.md).

    ``cancellations``: ``asked`` (the operation ids the run canceled), of them ``canceled`` (ended ``canceled``),
    ``canceled_before_post`` (those with reason ``canceled_before_submit``: no POST sent), ``canceled_at_provider``
    (the others: the provider's job was canceled), ``succeeded_first``
    (the provider's outcome won: ended ``succeeded``) and ``other`` (any other state: failed, uncertain, ...);
    ``asked_when``, given (the ledger's ``cancellations`` by ``state_when_asked``, ``not_in_ledger`` when the
    cancellation overtook its submission), as it is.

    ``canceled_outputs_delivered``: output-delivered events (``delivered``, their values) of operations that
    ended ``canceled`` or have a ``-> canceled`` step in ``transitions``; must be 0, since no output of a canceled
    operation is delivered after its canceled transition, and none can be before it (only ``succeeded``, a
    terminal state, saves outputs).
    """
    asked_ids = set(asked)
    ops = {o.operation_id: o for o in ledger}
    states = Counter(ops[op].state if op in ops else "missing" for op in asked_ids)
    canceled = {o.operation_id for o in ops.values() if o.state == "canceled"}
    canceled |= {op for op, _, to_state in transitions if to_state == "canceled"}
    before_post = sum(
        1
        for op in asked_ids
        if op in ops and ops[op].state == "canceled" and ops[op].reason_code == "canceled_before_submit"
    )
    return {
        "cancellations": {
            "asked": len(asked_ids),
            "canceled": states["canceled"],
            "canceled_before_post": before_post,
            "canceled_at_provider": states["canceled"] - before_post,
            "succeeded_first": states["succeeded"],
            "other": len(asked_ids) - states["canceled"] - states["succeeded"],
            **({"asked_when": dict(sorted(asked_when.items()))} if asked_when is not None else {}),
        },
        "canceled_outputs_delivered": sum(1 for value in delivered if value.get("operation_id") in canceled),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _decimal(value: Any) -> Decimal:
    """A decimal amount given as text (exact), 0 when absent or unreadable."""
    try:
        amount = Decimal(str(value)) if value is not None else Decimal(0)
    except InvalidOperation:
        return Decimal(0)
    return amount if amount.is_finite() else Decimal(0)


def _decimal_text(value: Decimal) -> str:
    return format(value.normalize(), "f") if value else "0"


def callback_counts(
    sent: Mapping[str, Any] | None,
    received: int,
    made_due: int,
    refused_by_reason: Mapping[str, int] | None = None,
) -> dict[str, Any] | None:
    """The report's ``callbacks`` (docs/callbacks.md): what the simulator planned and sent (``sent``: the
    ``callbacks`` of ``GET /_sim/summary``), what the workers recorded (``received``, ``made_due``), the
    deliveries the workers refused, by the HTTP status answered (``refused_<status>``: 401 bad signature or stale
    timestamp, 404 unknown job, 400 malformed, 413 too large, 503 ledger unavailable; 200 is a replay
    acknowledged, ``replays``) and, given ``refused_by_reason`` (the workers'
    ``streams_callbacks_refused_total{reason}``), ``refused_by_reason``. None when the simulator sent no
    callbacks."""
    if not sent or not sent.get("scheduled"):
        return None
    statuses = {int(k): int(v) for k, v in dict(sent.get("statuses", {})).items()}
    counts = {
        kind: int(sent.get(kind, 0))
        for kind in ("scheduled", "lost", "duplicated", "reordered", "bad_signature", "attempts", "unanswered")
    }
    counts |= {"received": received, "made_due": made_due, "replays": statuses.get(200, 0)}
    counts |= {f"refused_{status}": n for status, n in sorted(statuses.items()) if status >= 300}
    result: dict[str, Any] = dict(counts)
    if refused_by_reason is not None:
        result["refused_by_reason"] = dict(sorted(refused_by_reason.items()))
    return result


def render_table(report: Mapping[str, Any]) -> str:
    """A plain-text table of the report for the terminal."""
    rows: list[tuple[str, str]] = []
    for key, value in report.items():
        if isinstance(value, Mapping):
            inner = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
            rows.append((key, inner))
        else:
            rows.append((key, str(value)))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 50)
    return "\n".join([line, *(f"{k.ljust(width)}  {v}" for k, v in rows), line])


def broken_promises(report: Mapping[str, Any], *, repeats_allowed: bool) -> list[str]:
    """The report's must-be-zero figures that are not zero (empty when the run kept every promise).

    ``repeats_allowed``: an output event repeated with the *same* event id is legitimate after a relay crash
    (the soak kills workers); without faults (the main job) there must be none. With lookup on (``lookup`` in
    the report), no operation may stay ``uncertain`` when the provider created its job. The charges are compared
    only when the run's provider dialect (``dialect`` in the report, default the seed's) declares where the answers
    carry them.
    """
    checks = {
        "operations_missing": report["operations_missing"],
        "operations not final": report["operations_submitted"] - report["operations_final"],
        "remote jobs beyond one per operation": max(0, report["max_jobs_per_operation"] - 1),
        "orphan_jobs": report["orphan_jobs"],
        "GETs in flight beyond one per job": max(0, report["max_gets_in_flight_per_job"] - 1),
        "state_regressions": report["state_regressions"],
        "output duplicates after dedupe": report["output_duplicates_after_dedupe"],
        "outputs_undelivered": report["outputs_undelivered"],
        "outputs of canceled operations delivered": report.get("canceled_outputs_delivered", 0),
    }
    if load_dialect(report.get("dialect", DEFAULT_DIALECT)).answer.charge:
        # every charge the ledger saw is the provider's, and every job seen ending has its charge recorded
        checks["charges recorded minus the provider's for the jobs seen ending"] = _decimal(
            report["charges_total"]["recorded"]
        ) - _decimal(report["charges_total"]["provider_seen_ending"])
    if not repeats_allowed:
        checks["output_duplicates"] = report["output_duplicates"]
    if report.get("lookup"):
        checks["uncertain with a job the provider created (lookup on)"] = report["uncertain_with_provider_job"]
    return [f"{name}={value}" for name, value in checks.items() if value]
