"""The pure pieces the main job and the soak share (streams_harness.run): when a run is settled, its progress
line, its simulator's and workers' settings, its report's description of the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from streams.config import Settings
from streams.setup.admin import migrations_line, run_topics
from streams_harness.mainjob import MainJobOptions, processes_env
from streams_harness.run import (
    RUN_LOOKUP_LAG_S,
    RunOptions,
    final_count,
    isolate,
    progress_line,
    run_meta,
    settled,
    simulator_env,
    worker_settings,
)
from streams_harness.simulator.config import SimulatorConfig
from streams_harness.soak import SoakOptions

DONE = {"succeeded": 7, "failed": 1, "uncertain": 1, "stalled": 1, "outbox_pending": 0, "lookup_pending": 0}


def test_final_counts_terminal_uncertain_and_stalled() -> None:
    assert final_count({**DONE, "submitted": 4, "accepted": 2, "outbox_pending": 9, "lookup_pending": 9}) == 10


@pytest.mark.parametrize(
    ("counts", "lookup", "outbox", "expected"),
    [
        (DONE, False, True, True),
        ({**DONE, "succeeded": 6}, False, True, False),  # one short
        ({**DONE, "succeeded": 6, "submitted": 1}, False, True, False),
        ({**DONE, "outbox_pending": 3}, False, True, False),  # outputs not yet published
        ({**DONE, "outbox_pending": 3}, False, False, True),  # a program without an outbox
        ({**DONE, "lookup_pending": 1}, True, True, False),  # an uncertain operation still to be looked up
        ({**DONE, "lookup_pending": 1}, False, True, True),  # lookup off: nothing will look it up
        ({"succeeded": 10}, True, True, True),  # the extra counts may be absent
    ],
)
def test_settled(counts: dict[str, int], lookup: bool, outbox: bool, expected: bool) -> None:
    assert settled(counts, 10, lookup=lookup, outbox=outbox) is expected


def test_progress_line() -> None:
    counts = {**DONE, "submitted": 3, "outbox_pending": 4, "lookup_pending": 1}
    assert progress_line(counts, 13, 20, 2.0, lookup=True) == (
        "[   2.0s] submitted 13/20  final 10/20  (5 ops/s)  outbox pending 4  | "
        "failed=1 stalled=1 submitted=3 succeeded=7 uncertain=1 (lookups pending 1)"
    )
    assert progress_line({}, 0, 20, 0.0, lookup=False) == (
        "[   0.0s] submitted 0/20  final 0/20  (0 ops/s)  outbox pending 0  | "
    )


def test_the_simulator_env_is_one_the_simulator_reads() -> None:
    opts = RunOptions(seed=11, compression=30.0, lookup=True)
    settings = Settings(http_read_timeout_s=3.0)
    env = simulator_env(opts, settings, {"fault_429": 0.25, "fault_job_failed": 0.5})
    config = SimulatorConfig.from_env(env)
    assert (config.seed, config.compression, config.slow_response_s) == (11, 30.0, 5.0)
    assert (config.fault_429, config.fault_job_failed, config.fault_5xx) == (0.25, 0.5, 0.0)
    assert (config.lookup_enabled, config.lookup_lag_s) == (True, RUN_LOOKUP_LAG_S)


def test_worker_settings_look_up_after_the_simulator_lists_a_job() -> None:
    settings = worker_settings(Settings(), lookup=True)
    assert (settings.lookup_enabled, settings.lookup_lag_s, settings.max_observation_age_s) == (True, 2.0, 30.0)
    soak = worker_settings(Settings(), lookup=False, max_observation_age_s=60.0)
    assert (soak.lookup_enabled, soak.max_observation_age_s) == (False, 60.0)
    assert Settings.from_env(settings.to_env()) == settings  # what a worker process reads back


def test_a_run_is_isolated_by_database_topics_group_and_account() -> None:
    base = Settings(topic_prefix="t.", app_id="streams")
    run = isolate(base, "run42", "postgresql://streams:streams@127.0.0.1:5432/streams_run42")
    assert run.topic("submissions") == "t.run42.generation.submissions"
    assert (run.app_id, run.remote_account) == ("streams-run42", "run42")
    assert run.database_url.get_secret_value().endswith("/streams_run42")


def test_run_meta_and_report_file(tmp_path: Path) -> None:
    opts = MainJobOptions(trace="/data/mytrace.csv", start=5, workers=3, seed=9, lookup=True)
    meta = run_meta(opts, "run1", partitions=4, rows=100, faults={"fault_429": 0.1}, elapsed_s=12.345)
    assert meta == {
        "run_id": "run1",
        "workers": 3,
        "partitions": 4,
        "trace": "mytrace",
        "rows": 100,
        "start_row": 5,
        "compression": 15.0,
        "seed": 9,
        "faults": {"fault_429": 0.1},
        "lookup": True,
        "dialect": "seed-generations",
        "cancel_fraction": 0.05,
        "callbacks_enabled": True,
        "wall_clock_s": 12.3,
    }
    assert MainJobOptions(report_path=tmp_path / "r.json").report_file("run1") == tmp_path / "r.json"


def test_the_main_job_and_the_soak_keep_their_defaults() -> None:
    main, soak = MainJobOptions(), SoakOptions()
    assert (main.rows, main.workers, main.seed, main.timeout_s, main.partitions) == (2000, 2, 7, 900.0, 8)
    assert (soak.rows, soak.workers, soak.seed, soak.timeout_s, soak.faults) == (10_000, 3, 1, 1800.0, 20)
    assert main.faults == soak.sim_faults and main.faults is not soak.sim_faults


def test_the_main_jobs_processes_get_the_runs_settings() -> None:
    run = isolate(Settings(partitions=4), "run7", "postgresql://streams:streams@127.0.0.1:5432/streams_run7")
    opts = MainJobOptions(seed=3, lookup=True, faults={"fault_5xx": 0.2})
    env = processes_env(opts, run, 20123)
    worker = Settings.from_env(env)
    assert worker == worker_settings(run, lookup=True)
    assert (worker.remote_account, worker.app_id, worker.partitions) == ("run7", "generation-streams-run7", 4)
    simulator = SimulatorConfig.from_env({k: v for k, v in env.items() if k.startswith("SIM_")})
    assert (simulator.port, simulator.seed, simulator.fault_5xx, simulator.lookup_enabled) == (20123, 3, 0.2, True)


def test_a_runs_topics_are_its_five() -> None:
    run = isolate(Settings(), "run123", "postgresql://u:p@h:5432/streams_run123")
    assert run_topics(run) == [
        "run123.generation.submissions",
        "run123.generation.polls",
        "run123.generation.outputs.delivered",
        "run123.generation.transitions",
        "run123.generation.dead-letter",
        "run123.generation.cancellations",
    ]


@pytest.mark.parametrize(
    ("applied", "line"),
    [
        ([], "migrations applied: none (up to date)"),
        (["0019.x"], "migrations applied: 1 (0019.x)"),
        (["0001.ledger", "0002.y", "0003.z"], "migrations applied: 3 (0001.ledger .. 0003.z)"),
    ],
)
def test_the_migrations_of_a_run_are_one_line(applied: list[str], line: str) -> None:
    assert migrations_line(applied) == line
