"""The harness's commands hand every option to their job's options as given (``streams run``, ``soak``,
``bench``); the jobs themselves are replaced here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from streams_harness import bench, cli, mainjob, report, soak
from streams_harness.bench import BenchOptions
from streams_harness.mainjob import MainJobOptions
from streams_harness.run import DEFAULT_FAULTS
from streams_harness.soak import SoakOptions


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The options each job was started with (the job itself does not run)."""
    options: list[Any] = []

    def job(opts: Any) -> Any:
        options.append(opts)
        return opts

    for module, name in ((mainjob, "run_main_job"), (soak, "run_soak"), (bench, "run_bench")):
        monkeypatch.setattr(module, name, job)
    monkeypatch.setattr(cli, "_run_job", lambda coro, command: {"summary": {}})
    monkeypatch.setattr(report, "broken_promises", lambda report, repeats_allowed: [])
    return options


@pytest.mark.parametrize("command", [cli.run_command, cli.soak_command])
def test_lookup_with_a_dialect_without_lookup_is_refused(started: list[Any], command: Any) -> None:
    result = CliRunner().invoke(command, ["--lookup", "--dialect", "replicate-predictions"])
    assert result.exit_code == 2 and started == []
    assert "replicate-predictions declares no lookup by client reference" in result.output
    assert CliRunner().invoke(command, ["--dialect", "replicate-predictions"]).exit_code == 0


def test_run_options(started: list[Any], tmp_path: Path) -> None:
    args = ["--trace", "code", "--start", "3", "--rows", "5", "--compression", "2", "--workers", "3"]
    args += ["--seed", "2", "--keep", "--lookup", "--report", str(tmp_path / "r.json"), "--timeout-s", "10"]
    args += ["--partitions", "4", "--no-faults", "--fault", "429=0.5", "--cancel-fraction", "0.2", "--no-callbacks"]
    result = CliRunner().invoke(cli.run_command, args)
    assert result.exit_code == 0, result.output
    assert started == [
        MainJobOptions(
            trace="code",
            start=3,
            rows=5,
            compression=2.0,
            workers=3,
            seed=2,
            keep=True,
            lookup=True,
            report_path=tmp_path / "r.json",
            timeout_s=10.0,
            partitions=4,
            faults={"fault_429": 0.5},
            cancel_fraction=0.2,
            callbacks=False,
            callback_faults={},  # --no-faults: none on the callbacks either
        )
    ]


def test_run_defaults(started: list[Any]) -> None:
    assert CliRunner().invoke(cli.run_command, []).exit_code == 0
    assert started == [MainJobOptions(faults=dict(DEFAULT_FAULTS))]


def test_soak_options_and_defaults(started: list[Any]) -> None:
    assert CliRunner().invoke(cli.soak_command, []).exit_code == 0
    args = ["--rows", "300", "--workers", "2", "--faults", "7", "--seed", "5", "--compression", "10", "--lookup"]
    args += ["--cancel-fraction", "0", "--no-callbacks"]
    result = CliRunner().invoke(cli.soak_command, args)
    assert result.exit_code == 0, result.output
    assert started == [
        SoakOptions(),
        SoakOptions(
            rows=300, workers=2, faults=7, seed=5, compression=10.0, lookup=True, cancel_fraction=0.0, callbacks=False
        ),
    ]


def test_bench_options(started: list[Any]) -> None:
    args = ["--operations", "50", "--workers", "1,2", "--sim-latency-ms", "5", "--no-profile"]
    result = CliRunner().invoke(cli.bench_command, args)
    assert result.exit_code == 0, result.output
    assert started == [BenchOptions(operations=50, workers=(1, 2), sim_get_latency_ms=5.0, profile=False)]


def test_bench_with_no_worker_counts_runs_the_other_runs_alone(started: list[Any]) -> None:
    args = ["--workers", "", "--no-floor", "--no-naive", "--no-procrastinate", "--no-profile", "--paced-rate", "0"]
    result = CliRunner().invoke(cli.bench_command, [*args, "--callbacks-comparison"])
    assert result.exit_code == 0, result.output
    assert started == [
        BenchOptions(
            workers=(),
            floor=False,
            naive=False,
            procrastinate=False,
            profile=False,
            paced_rate_per_s=0.0,
            callbacks_comparison=True,
        )
    ]
    refused = CliRunner().invoke(cli.bench_command, ["--workers", "1,0"])
    assert refused.exit_code == 2 and "each at least 1" in refused.output
