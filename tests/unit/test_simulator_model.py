"""Pure parts of the provider simulator: duration model, fault decisions, config."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from streams_harness.replay import trace_request
from streams_harness.simulator.cli import command
from streams_harness.simulator.config import SimulatorConfig
from streams_harness.simulator.faults import FaultDecider, FaultRates, PostFault
from streams_harness.simulator.model import (
    JobDurations,
    JobRequest,
    job_durations,
    job_schedule,
    poll_after_ms,
    prompt_tokens,
    read_request,
    status_at,
)
from streams_harness.trace import TraceRow


def test_default_durations_exact() -> None:
    d = job_durations(50_000, 40)
    assert d == JobDurations(queue_ms=200.0, prefill_ms=1000.0, decode_ms=1000.0)
    assert d.running_ms == 2000.0
    assert d.total_ms == 2200.0


def test_zero_context_one_token() -> None:
    d = job_durations(0, 1)
    assert d == JobDurations(queue_ms=200.0, prefill_ms=0.0, decode_ms=25.0)
    assert d.total_ms == 225.0


def test_compression_divides_every_phase() -> None:
    d = job_durations(10_000, 400, compression=4.0)
    assert d == JobDurations(queue_ms=50.0, prefill_ms=50.0, decode_ms=2500.0)
    assert d.total_ms == 2600.0


def test_constants_are_parameters() -> None:
    d = job_durations(100, 10, queue_ms=0.0, prefill_ms_per_token=1.0, decode_ms_per_token=2.0, compression=2.0)
    assert d == JobDurations(queue_ms=0.0, prefill_ms=50.0, decode_ms=10.0)


def test_config_durations_use_config_fields() -> None:
    cfg = SimulatorConfig(compression=60.0, queue_ms=120.0, prefill_ms_per_token=0.06, decode_ms_per_token=30.0)
    assert cfg.durations(1000, 2) == JobDurations(queue_ms=2.0, prefill_ms=1.0, decode_ms=1.0)


@pytest.mark.parametrize(("ctx", "gen", "compression"), [(-1, 1, 1.0), (0, 0, 1.0), (0, 1, 0.0)])
def test_invalid_inputs_rejected(ctx: int, gen: int, compression: float) -> None:
    with pytest.raises(ValueError):
        job_durations(ctx, gen, compression=compression)


def test_schedule_and_status_boundaries() -> None:
    started, completed = job_schedule(1000.0, JobDurations(queue_ms=500.0, prefill_ms=250.0, decode_ms=250.0))
    assert (started, completed) == (1000.5, 1001.0)
    assert status_at(1000.0, started, completed, "succeeded") == "queued"
    assert status_at(1000.4999, started, completed, "succeeded") == "queued"
    assert status_at(1000.5, started, completed, "succeeded") == "running"
    assert status_at(1000.9999, started, completed, "failed") == "running"
    assert status_at(1001.0, started, completed, "failed") == "failed"
    assert status_at(1001.0, started, completed, "succeeded") == "succeeded"


def test_poll_after_ms_clamped() -> None:
    assert poll_after_ms(100.0, 100.3) == 300
    assert poll_after_ms(100.0, 100.01) == 50
    assert poll_after_ms(100.0, 99.0) == 50
    assert poll_after_ms(100.0, 200.0) == 5000
    assert poll_after_ms(100.0, 200.0, min_ms=10, max_ms=20) == 20


def _decisions(seed: int, rates: FaultRates, n: int) -> list[tuple[PostFault | None, bool, int]]:
    d = FaultDecider(seed)
    out = []
    for _ in range(n):
        dec = d.decide_post(rates)
        out.append((dec.fault, dec.create_job, dec.status))
    return out


def test_fault_decisions_are_seeded() -> None:
    rates = FaultRates(rate_limited_429=0.2, upstream_502=0.2, internal_5xx=0.2, drop_after_create=0.1)
    assert _decisions(7, rates, 200) == _decisions(7, rates, 200)
    assert _decisions(7, rates, 200) != _decisions(8, rates, 200)


def test_fault_order_and_rate_one() -> None:
    d = FaultDecider(1)
    everything = FaultRates(
        rate_limited_429=1.0, upstream_502=1.0, internal_5xx=1.0, drop_after_create=1.0, slow_response=1.0
    )
    dec = d.decide_post(everything)
    assert (dec.fault, dec.create_job, dec.status) == (PostFault.RATE_LIMITED_429, False, 429)
    dec = d.decide_post(FaultRates(upstream_502=1.0, internal_5xx=1.0))
    assert (dec.fault, dec.create_job, dec.status) == (PostFault.UPSTREAM_502, True, 502)
    dec = d.decide_post(FaultRates(drop_after_create=1.0, slow_response=1.0))
    assert (dec.fault, dec.create_job, dec.status) == (PostFault.DROP_AFTER_CREATE, True, 0)
    dec = d.decide_post(FaultRates(slow_response=1.0))
    assert (dec.fault, dec.create_job, dec.status) == (PostFault.SLOW_RESPONSE, True, 201)
    dec = d.decide_post(FaultRates())
    assert (dec.fault, dec.create_job, dec.status) == (None, True, 201)


def test_5xx_creates_about_half() -> None:
    decs = _decisions(3, FaultRates(internal_5xx=1.0), 1000)
    assert {s for _, _, s in decs} == {500, 503}
    created = sum(1 for _, c, _ in decs if c)
    assert 400 < created < 600


def test_job_traits_rates() -> None:
    d = FaultDecider(5)
    traits = [d.job_traits(FaultRates(job_failed=0.0, multi_output=0.1)) for _ in range(2000)]
    assert not any(t.fails for t in traits)
    two = sum(1 for t in traits if t.outputs == 2)
    assert 120 < two < 280
    assert d.job_traits(FaultRates(job_failed=1.0, multi_output=1.0)).fails
    assert d.job_traits(FaultRates(job_failed=1.0, multi_output=1.0)).outputs == 2


def test_config_defaults_and_validation() -> None:
    cfg = SimulatorConfig()
    assert (cfg.queue_ms, cfg.prefill_ms_per_token, cfg.decode_ms_per_token, cfg.compression) == (
        200.0,
        0.02,
        25.0,
        1.0,
    )
    assert (cfg.fault_429, cfg.fault_5xx, cfg.get_latency_ms, cfg.poll_min_ms, cfg.poll_max_ms) == (
        0.0,
        0.0,
        5.0,
        50,
        5000,
    )
    with pytest.raises(ValueError):
        SimulatorConfig(fault_429=1.5)
    with pytest.raises(ValueError):
        SimulatorConfig(compression=0.0)
    with pytest.raises(ValueError):
        cfg.updated({"no_such_field": 1})
    with pytest.raises(ValueError):
        cfg.updated({"fault_slow": "abc"})
    with pytest.raises(ValueError):
        cfg.updated({"port": 1}, allow_static=False)
    assert cfg.updated({"fault_slow": 1, "get_latency_ms": 0}).fault_slow == 1.0


def test_config_from_env() -> None:
    cfg = SimulatorConfig.from_env(
        {"SIM_SEED": "7", "SIM_COMPRESSION": "60", "SIM_FAULT_429": "0.02", "SIM_ACCESS_LOG": "true", "OTHER": "x"}
    )
    assert (cfg.seed, cfg.compression, cfg.fault_429, cfg.access_log) == (7, 60.0, 0.02, True)
    assert cfg.fault_rates.rate_limited_429 == 0.02


def test_cli_help_lists_every_option() -> None:
    result = CliRunner().invoke(command, ["--help"])
    assert result.exit_code == 0, result.output
    for opt in (
        "--seed",
        "--compression",
        "--fault-502-job-id",
        "--fault-5xx",
        "--fault-drop-after-create",
        "--fault-slow",
        "--slow-response-s",
        "--fault-429",
        "--retry-after-s",
        "--fault-job-failed",
        "--get-latency-ms",
        "--host",
        "--port",
    ):
        assert opt in result.output


def test_cli_rejects_bad_rate() -> None:
    result = CliRunner().invoke(command, ["--fault-429", "2"])
    assert result.exit_code != 0
    assert "fault_429" in result.output


# --- what the simulator reads from a request -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [("", 0), ("   ", 0), ("Write a haiku about leases", 5), ("leases.", 2), ("don't stop!", 5), ("h\u00e9 \u2603", 2)],
)
def test_prompt_tokens(prompt: str, tokens: int) -> None:
    assert prompt_tokens(prompt) == tokens


def test_read_request_takes_what_a_provider_reads() -> None:
    body = {
        "model": "genace-1",
        "input": {"prompt": "Write a haiku about leases", "max_tokens": 32, "stop": ["\n"]},
        "temperature": 0.7,
        "metadata": {"client_reference": "op-1", "user": "u"},
    }
    assert read_request(body) == JobRequest("genace-1", 5, 32, "op-1")
    assert read_request({"model": "m", "input": {"prompt": "", "max_tokens": 1}}) == JobRequest("m", 0, 1, None)


@pytest.mark.parametrize("row", [0, 1, 2, 5, 11, 12, 13, 14_050])
def test_replay_prompts_have_the_trace_rows_context_tokens(row: int) -> None:
    trace_row = TraceRow(row=0, arrival_s=0.0, context_tokens=row, generated_tokens=7)
    request = trace_request(trace_row, "sim-1")
    assert request["model"] == "sim-1" and request["input"]["max_tokens"] == 7
    asked = read_request(request)
    assert (asked.context_tokens, asked.generated_tokens) == (row, 7)
    assert SimulatorConfig().durations(asked.context_tokens, 7) == job_durations(row, 7)
