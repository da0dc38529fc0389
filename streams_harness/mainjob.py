"""The main job: replay a real trace through simulator + workers and report what happened.

Steps: migrations and topics -> simulator and N worker processes from the ``Procfile`` (run by honcho) ->
trace replay (time-compressed) with progress -> wait until every operation is final and the outbox is
drained -> report from independent records (:mod:`streams_harness.report`) -> stop the processes. The steps it
shares with the soak are :mod:`streams_harness.run`'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import asyncpg

from streams.config import Settings
from streams.errors import StreamsError
from streams.ledger.pool import create_pool
from streams.setup.admin import create_topics, database_name, migrations_line
from streams_harness.cancels import callback_secret
from streams_harness.checkout import checkout_dir
from streams_harness.fleet import free_port, free_port_block, tail, wait_healthy
from streams_harness.report import REPORT
from streams_harness.run import (
    DEFAULT_FAULTS,
    RunOptions,
    RunSteps,
    collect_report,
    isolated_run,
    migrate_quietly,
    replay_until_final,
    run_cancellations,
    run_dir,
    run_meta,
    simulator_env,
    worker_settings,
    write_report,
)
from streams_harness.services import wait_group_stable
from streams_harness.trace import TraceRow, read_trace


class MainJobError(StreamsError):
    """The main job cannot start or its processes failed; the message says why and where the logs are."""


@dataclass
class MainJobOptions(RunOptions):
    """Options of ``streams run`` (see its ``--help``); the common ones are :class:`RunOptions`'."""

    partitions: int = 8
    #: The simulator's fault rates (``fault_429``, ...); "with faults on" (the default) is :data:`DEFAULT_FAULTS`.
    faults: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_FAULTS))
    #: honcho's base port (workers' web ports are base+100+i); None: a free block below the ephemeral range.
    base_port: int | None = None
    #: Give the run its own topics and consumer group (default); False uses the environment's, e.g. for a test
    #: that publishes to those topics before the run.
    isolate: bool = True


class Processes:
    """The simulator and the workers, run by honcho from the Procfile in their own process group."""

    def __init__(self, env: dict[str, str], workers: int, base_port: int, log_path: Path) -> None:
        self.env = env
        self.workers = workers
        self.base_port = base_port
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        """Start ``honcho start`` with ``simulator=1,worker=N``; output goes to ``log_path``. Returns honcho's
        process."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        honcho = str(Path(sys.executable).with_name("honcho"))
        root = checkout_dir()
        self.proc = subprocess.Popen(
            [
                honcho,
                "start",
                "-f",
                str(root / "Procfile"),
                "-d",
                str(root),
                "-c",
                f"simulator=1,worker={self.workers}",
                "-p",
                str(self.base_port),
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self.proc

    def worker_ports(self) -> list[int]:
        """Web ports of the workers (honcho: base + 100 per process type + instance)."""
        return [self.base_port + 100 + i for i in range(self.workers)]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def processes_env(opts: MainJobOptions, settings: Settings, sim_port: int, callback_url: str = "") -> dict[str, str]:
    """The environment of honcho and the processes of the ``Procfile``: this process's, with the workers'
    settings (``STREAMS_*``: the run's database, topics, consumer group, provider account, reconciliation) and the
    simulator's (``SIM_*``, on ``sim_port``), and this virtualenv first on the ``PATH``. With ``callback_url``
    (``opts.callbacks``), the workers serve completion callbacks and the simulator sends them there, signed with
    a secret made for the run."""
    env = dict(os.environ)
    secret = callback_secret() if callback_url else None
    workers = worker_settings(settings, lookup=opts.lookup, callback_secret=secret)
    env.update(workers.replace(provider_dialect=opts.dialect).to_env())
    env.update(simulator_env(opts, settings, opts.faults, callback_url=callback_url, callback_secret=secret or ""))
    env["SIM_PORT"] = str(sim_port)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def run_main_job(opts: MainJobOptions, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run the main job end to end; returns the report (also printed, and written as JSON).

    Isolated (the default): the run gets its own ledger database, topics and consumer group on the shared
    services (:func:`streams_harness.run.isolated_run`), so nothing of another run (or of an aborted one) reaches
    its workers; they are removed after the report unless ``keep``. Not isolated: the environment's, one main
    job at a time (a lock).

    Raises:
        RunStoppedError: an error stopped the run, in the step it names; its cause is the error: MainJobError
            (another main job holds the environment's ledger, or the processes exited), ProcessError (the simulator
            or a worker did not become healthy), a service's error.
    """
    checkout_dir()  # outside a clone, fail before anything is created
    steps = RunSteps()
    try:
        return await _main_job(opts, out, steps)
    except Exception as exc:
        raise steps.stopped(exc) from exc


async def _main_job(opts: MainJobOptions, out: TextIO, steps: RunSteps) -> dict[str, Any]:
    run_id = f"run{int(time.time())}"
    sim_port = free_port()
    settings = Settings.from_env().replace(partitions=opts.partitions, remote_base_url=f"http://127.0.0.1:{sim_port}")
    rows = read_trace(opts.trace, start=opts.start, rows=opts.rows)
    print(
        f"main job {run_id}: {len(rows)} rows of trace {opts.trace_name!r} from row {opts.start}, "
        f"compression {opts.compression}x, {opts.workers} workers, faults {opts.faults or 'off'}, "
        f"lookup {'on' if opts.lookup else 'off'}, callbacks {'on' if opts.callbacks else 'off'}, "
        f"{opts.cancel_fraction:.0%} canceled",
        file=out,
    )
    if opts.isolate:
        async with isolated_run(settings, run_id, keep=opts.keep, out=out, steps=steps) as run_settings:
            return await _run(opts, run_settings, run_id, sim_port, rows, out, steps)
    steps.enter("set-up: migrate the database and create the topics")
    database_url = settings.database_url.get_secret_value()
    print(f"database {database_name(database_url)}: {migrations_line(migrate_quietly(database_url))}", file=out)
    await create_topics(settings)
    lock = await asyncpg.connect(settings.database_url.get_secret_value())
    if not await REPORT.try_main_job_lock.fetchval(lock):
        await lock.close()
        raise MainJobError(
            "another main job is running on this ledger (PostgreSQL advisory lock held); wait for it to finish "
            "or point STREAMS_DATABASE_URL at another database"
        )
    try:
        return await _run(opts, settings, run_id, sim_port, rows, out, steps)
    finally:
        await lock.close()


async def _run(
    opts: MainJobOptions,
    settings: Settings,
    run_id: str,
    sim_port: int,
    rows: list[TraceRow],
    out: TextIO,
    steps: RunSteps,
) -> dict[str, Any]:
    steps.enter("start: the simulator and the workers")
    log_path = run_dir(run_id) / "processes.log"
    base_port = opts.base_port or free_port_block([0, *(100 + i for i in range(opts.workers))])
    # any worker may take a callback (the ledger is shared): the simulator sends them all to the first one
    callback_url = f"http://127.0.0.1:{base_port + 100}{settings.callback_path}" if opts.callbacks else ""
    procs = Processes(processes_env(opts, settings, sim_port, callback_url), opts.workers, base_port, log_path)
    honcho = procs.start()
    print(f"processes started (honcho, logs: {log_path})", file=out)

    def check() -> None:
        if honcho.poll() is not None:
            raise MainJobError(f"worker processes exited; see the end of {log_path}:\n{tail(log_path)}")

    try:
        pool = await create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=2)
    except BaseException:
        procs.stop()  # the processes started: never leave them running
        raise
    try:
        await wait_healthy(f"{settings.remote_base_url.get_secret_value()}/healthz", 60, honcho, log_path)
        for port in procs.worker_ports():
            await wait_healthy(f"http://127.0.0.1:{port}/healthz", 120, honcho, log_path)
        # Measure the steady state: start the replay once every worker has its partitions (no start-up rebalance).
        if not await wait_group_stable(settings, opts.workers, 60):
            print("warning: the consumer group did not settle within 60 s; replaying anyway", file=out)
        steps.enter("replay: submit the trace and wait until every operation is final")
        cancels = run_cancellations(rows, opts, run_id)
        ids, elapsed_s = await replay_until_final(
            settings, pool, rows, opts, run_id, out=out, interval_s=2.0, check=check, cancels=cancels
        )
        meta = run_meta(
            opts, run_id, partitions=opts.partitions, rows=len(rows), faults=opts.faults, elapsed_s=elapsed_s
        )
        steps.enter("report: read the ledger, the simulator and the outputs topic")
        report = await collect_report(
            settings,
            pool,
            f"{run_id}-%",
            ids,
            meta,
            cancels=cancels,
            worker_urls=[f"http://127.0.0.1:{port}" for port in procs.worker_ports()],
        )
    finally:
        await pool.close()
        procs.stop()
    write_report(report, opts.report_file(run_id), out)
    return report
