"""A harness run's cancellations and callbacks (streams_harness.cancels): the seeded plan, the messages, the report's
cancellation figures and the canceled-output promise, and the callback wiring of the main job's processes."""

from __future__ import annotations

import orjson
import pytest

from streams.config import Settings
from streams.errors import InvalidEventError
from streams.model.codes import ReasonCode
from streams.wire import contracts
from streams_harness.cancels import (
    AT_SUBMISSION,
    AT_SUBMISSION_SHARE,
    STAGGER_MAX_TRACE_S,
    WHILE_RUNNING,
    cancellation,
    cancellation_plan,
)
from streams_harness.mainjob import MainJobOptions, processes_env
from streams_harness.report import LedgerOperation, broken_promises, build_report, callback_counts
from streams_harness.run import DEFAULT_CALLBACK_FAULTS, RUN_CALLBACK_FALLBACK_POLL_S, isolate
from streams_harness.simulator.config import SimulatorConfig
from streams_harness.trace import TraceRow

ROWS = [TraceRow(row=i, arrival_s=2.0 * i, context_tokens=10, generated_tokens=(i * 37) % 400) for i in range(400)]
IDS = [f"run1-conv-{r.row:06d}" for r in ROWS]


def test_the_plan_cancels_a_seeded_fraction_some_at_submission_some_while_running() -> None:
    plan = cancellation_plan(ROWS, IDS, fraction=0.05, compression=10.0, seed=7)
    assert len(plan) == 20 and len({c.operation_id for c in plan}) == 20
    assert plan == cancellation_plan(ROWS, IDS, fraction=0.05, compression=10.0, seed=7)  # seeded
    assert plan != cancellation_plan(ROWS, IDS, fraction=0.05, compression=10.0, seed=8)
    arrival_s = {op: row.arrival_s / 10.0 for op, row in zip(IDS, ROWS, strict=True)}
    assert all(c.at_s == arrival_s[c.operation_id] for c in plan)
    at_submission = [c for c in plan if c.kind == AT_SUBMISSION]
    while_running = [c for c in plan if c.kind == WHILE_RUNNING]
    assert at_submission and while_running  # both kinds, in about the planned share
    assert abs(len(at_submission) / len(plan) - AT_SUBMISSION_SHARE) < 0.3
    assert all(c.lag_s == 0.0 for c in at_submission)
    assert all(0.0 <= c.lag_s <= STAGGER_MAX_TRACE_S / 10.0 for c in while_running)
    assert len({c.lag_s for c in while_running}) == len(while_running)  # staggered
    # the while-running ones among the longest jobs (the top quarter of the generated tokens: 300 and more)
    tokens = {op: row.generated_tokens for op, row in zip(IDS, ROWS, strict=True)}
    assert all(tokens[c.operation_id] >= 300 for c in while_running)
    assert not all(tokens[c.operation_id] >= 300 for c in at_submission)


@pytest.mark.parametrize(("fraction", "expected"), [(0.0, 0), (0.001, 1), (1.0, 400)])
def test_the_plan_size(fraction: float, expected: int) -> None:
    assert len(cancellation_plan(ROWS, IDS, fraction=fraction, compression=1.0, seed=1)) == expected
    assert cancellation_plan([], [], fraction=0.5, compression=1.0, seed=1) == []


def test_a_cancellation_is_a_valid_message_of_the_topic() -> None:
    value = cancellation("run1-conv-000003")
    decoded = orjson.loads(value)
    assert contracts.decode("generation.cancellations", value, 1024) is not None
    assert (decoded["operation_id"], decoded["requested_by"]) == ("run1-conv-000003", "streams-harness")
    with pytest.raises(InvalidEventError):
        cancellation("bad id with spaces")


def ledger_op(operation_id: str, state: str, reason: ReasonCode | None = None) -> LedgerOperation:
    return LedgerOperation(operation_id, state, reason, 1_000, 2_000, 1 if state == "succeeded" else 0, None)


def cancel_report(delivered_to: list[str]) -> dict[str, object]:
    ledger = [
        ledger_op("a", "canceled", ReasonCode.CANCELED_BEFORE_SUBMIT),
        ledger_op("b", "canceled"),  # canceled at the provider
        ledger_op("c", "succeeded"),  # the provider's outcome won
        ledger_op("d", "failed"),
        ledger_op("e", "succeeded"),  # not asked
    ]
    delivered = [
        ({"operation_id": op, "event_id": f"ev-{op}", "output_id": "o1", "remote_job_id": "j"}, 3_000)
        for op in delivered_to
    ]
    return build_report(
        submitted_ids=[o.operation_id for o in ledger],
        ledger=ledger,
        sim_jobs=[],
        delivered=delivered,
        meta={},
        transitions=[("a", None, "accepted"), ("a", "accepted", "canceled")],
        cancel_asked=["a", "b", "c", "d"],
        cancel_asked_when={"not_in_ledger": 1, "accepted": 0, "running": 3},
    )


def test_the_report_counts_the_cancellations_by_outcome() -> None:
    report = cancel_report(["c", "e"])
    assert report["cancellations"] == {
        "asked": 4,
        "canceled": 2,
        "canceled_before_post": 1,
        "canceled_at_provider": 1,
        "succeeded_first": 1,
        "other": 1,
        "asked_when": {"accepted": 0, "not_in_ledger": 1, "running": 3},
    }
    assert report["canceled_outputs_delivered"] == 0
    assert broken_promises(report, repeats_allowed=False) == []


def test_an_output_of_a_canceled_operation_delivered_is_a_broken_promise() -> None:
    report = cancel_report(["c", "e", "b", "a"])
    assert report["canceled_outputs_delivered"] == 2
    assert "outputs of canceled operations delivered=2" in broken_promises(report, repeats_allowed=True)


def test_the_callbacks_entry_carries_the_refusals_by_reason() -> None:
    sent = {"scheduled": 4, "attempts": 6, "statuses": {"204": 3, "401": 3}}
    counts = callback_counts(sent, received=3, made_due=2, refused_by_reason={"bad_signature": 3})
    assert counts is not None
    assert (counts["refused_401"], counts["refused_by_reason"]) == (3, {"bad_signature": 3})


def test_the_main_jobs_workers_take_the_callbacks_the_simulator_signs() -> None:
    run = isolate(Settings(partitions=4), "run7", "postgresql://streams:streams@127.0.0.1:5432/streams_run7")
    url = "http://127.0.0.1:20223/callbacks/generation"
    env = processes_env(MainJobOptions(seed=3), run, 20123, callback_url=url)
    worker = Settings.from_env(env)
    simulator = SimulatorConfig.from_env({k: v for k, v in env.items() if k.startswith("SIM_")})
    assert worker.callbacks_enabled and worker.web_enabled
    assert worker.callback_fallback_poll_interval_s == RUN_CALLBACK_FALLBACK_POLL_S
    assert worker.callback_secrets.get_secret_value() == simulator.callback_secret  # one generated secret
    assert simulator.callback_secret.startswith("whsec_")
    assert simulator.callback_url == url
    faults = {name: getattr(simulator, name) for name in DEFAULT_CALLBACK_FAULTS}
    assert faults == DEFAULT_CALLBACK_FAULTS and simulator.callback_bad_signature > 0
    off = processes_env(MainJobOptions(seed=3, callbacks=False), run, 20123)
    assert not Settings.from_env(off).callbacks_enabled
    assert SimulatorConfig.from_env({k: v for k, v in off.items() if k.startswith("SIM_")}).callback_url == ""
