"""The main job: replay a real trace through simulator + workers and report what happened.

Steps: migrations and topics -> simulator and N worker processes from the ``Procfile`` (run by honcho) ->
trace replay (time-compressed) with progress -> wait until every operation is final and the outbox is
drained -> report from independent records (:mod:`streams_harness.report`) -> stop the processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson

from streams.admin import (
    create_run_database,
    create_topics,
    delete_topics,
    drop_run_database,
    migrate,
    wait_group_stable,
)
from streams.config import Settings
from streams.downstream import read_topic_to_end
from streams.errors import StreamsError
from streams.ledger import Ledger, create_pool
from streams.producer import SubmissionProducer
from streams_harness.checkout import checkout_dir
from streams_harness.fleet import free_port, free_port_block, tail, wait_healthy
from streams_harness.replay import replay_trace
from streams_harness.report import (
    FINAL_STATES,
    REPORT,
    LedgerAccounting,
    LedgerOperation,
    build_report,
    render_table,
)
from streams_harness.trace import TraceRow, read_trace


class MainJobError(StreamsError):
    """The main job cannot start or its processes failed; the message says why and where the logs are."""


#: Fault rates used when the main job runs "with faults on" (the default).
DEFAULT_FAULTS: dict[str, float] = {
    "fault_429": 0.01,
    "fault_502_job_id": 0.01,
    "fault_5xx": 0.005,
    "fault_drop_after_create": 0.005,
    "fault_slow": 0.002,
    "fault_job_failed": 0.01,
    "fault_not_found": 0.005,
    "fault_unknown_status": 0.002,
    "fault_never_finishes": 0.002,
    "fault_status_regression": 0.01,
}


#: Maximum observation age of a harness run's workers (s): a job that never finishes stalls this long after its
#: id was saved (the product's default, 24 h, would outlast the run); far beyond any job of the traces.
RUN_MAX_OBSERVATION_AGE_S = 30.0

#: The simulator's lookup consistency lag in a run with lookup on (s); the workers wait one more second.
RUN_LOOKUP_LAG_S = 1.0


def run_settings_env(lookup: bool, max_observation_age_s: float = RUN_MAX_OBSERVATION_AGE_S) -> dict[str, str]:
    """``STREAMS_*`` and ``SIM_*`` variables of a harness run's workers and simulator for reconciliation."""
    return {
        "STREAMS_MAX_OBSERVATION_AGE_S": str(max_observation_age_s),
        "STREAMS_LOOKUP_ENABLED": "true" if lookup else "false",
        "STREAMS_LOOKUP_LAG_S": str(RUN_LOOKUP_LAG_S + 1.0),
        "SIM_LOOKUP_ENABLED": "true" if lookup else "false",
        "SIM_LOOKUP_LAG_S": str(RUN_LOOKUP_LAG_S),
    }


@dataclass
class MainJobOptions:
    """Options of ``streams run`` (see its ``--help``)."""

    trace: str = "conv"
    start: int = 0
    rows: int = 2000
    compression: float = 15.0
    workers: int = 2
    partitions: int = 8
    seed: int = 7
    faults: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_FAULTS))
    report_path: Path | None = None
    timeout_s: float = 900.0
    #: honcho's base port (workers' web ports are base+100+i); None: a free block below the ephemeral range.
    base_port: int | None = None
    #: Keep the run's database and topics after the report (isolated runs only).
    keep: bool = False
    #: Give the run its own topics and consumer group (default); False uses the environment's, e.g. for a test
    #: that publishes to those topics before the run.
    isolate: bool = True
    #: Reconcile uncertain operations by lookup of the client reference (the simulator offers it for the run).
    lookup: bool = False


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


async def progress(pool: asyncpg.Pool, pattern: str) -> dict[str, int]:
    """Operation counts by state (plus ``outbox_pending``) for the run."""
    rows = await pool.fetch(REPORT.run_progress, pattern)
    return {r["state"]: r["n"] for r in rows}


def _line(counts: dict[str, int], submitted: int, total: int, started: float, lookup: bool) -> str:
    final = sum(n for s, n in counts.items() if s in FINAL_STATES)
    states = " ".join(
        f"{s}={n}" for s, n in sorted(counts.items()) if s not in ("outbox_pending", "lookup_pending") and n
    )
    if lookup and counts.get("lookup_pending"):
        states += f" (lookups pending {counts['lookup_pending']})"
    rate = final / max(0.001, time.monotonic() - started)
    return (
        f"[{time.monotonic() - started:6.1f}s] submitted {submitted}/{total}  final {final}/{total}  "
        f"({rate:.0f} ops/s)  outbox pending {counts.get('outbox_pending', 0)}  | {states}"
    )


async def run_main_job(opts: MainJobOptions, out: Any = sys.stdout) -> dict[str, Any]:
    """Run the main job end to end; returns the report (also printed, and written as JSON if asked).

    Isolated (the default): the run gets its own ledger database, topics and consumer group on the shared
    services, so nothing of another run (or of an aborted one) reaches its workers; all three are removed
    after the report unless ``keep``. Not isolated: the environment's, one main job at a time (a lock).
    """
    checkout_dir()  # outside a clone, fail before anything is created
    run_id = f"run{int(time.time())}"
    base = Settings.from_env()
    sim_port = free_port()
    settings = base.replace(partitions=opts.partitions, remote_base_url=f"http://127.0.0.1:{sim_port}")
    rows = read_trace(opts.trace, start=opts.start, rows=opts.rows)
    print(
        f"main job {run_id}: {len(rows)} rows of trace {Path(opts.trace).stem!r} from row {opts.start}, "
        f"compression {opts.compression}x, {opts.workers} workers, faults {opts.faults or 'off'}, "
        f"lookup {'on' if opts.lookup else 'off'}",
        file=out,
    )
    if opts.isolate:
        settings = settings.replace(
            topic_prefix=f"{base.topic_prefix}{run_id}.",
            app_id=f"{base.app_id}-{run_id}",
            remote_account=run_id,  # the run's own simulator is its own provider account: its own rate budget
            database_url=await create_run_database(base.database_url.get_secret_value(), run_id),
        )
        try:
            migrate(settings.database_url.get_secret_value())
            return await _run(opts, settings, run_id, sim_port, rows, out)
        finally:
            if not opts.keep:
                await drop_run_database(base.database_url.get_secret_value(), settings.database_url.get_secret_value())
                await delete_topics(settings)
    migrate(settings.database_url.get_secret_value())
    lock = await asyncpg.connect(settings.database_url.get_secret_value())
    if not await lock.fetchval(REPORT.try_main_job_lock):
        await lock.close()
        raise MainJobError(
            "another main job is running on this ledger (PostgreSQL advisory lock held); wait for it to finish "
            "or point STREAMS_DATABASE_URL at another database"
        )
    try:
        return await _run(opts, settings, run_id, sim_port, rows, out)
    finally:
        await lock.close()


async def _run(
    opts: MainJobOptions, settings: Settings, run_id: str, sim_port: int, rows: list[TraceRow], out: Any
) -> dict[str, Any]:
    trace_name = Path(opts.trace).stem
    await create_topics(settings)

    env = dict(os.environ)
    env["STREAMS_TOPIC_PREFIX"] = settings.topic_prefix
    env["STREAMS_APP_ID"] = settings.app_id
    env["STREAMS_DATABASE_URL"] = settings.database_url.get_secret_value()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        {
            "STREAMS_REMOTE_BASE_URL": settings.remote_base_url.get_secret_value(),
            "STREAMS_PARTITIONS": str(opts.partitions),
            "SIM_PORT": str(sim_port),
            "SIM_SEED": str(opts.seed),
            "SIM_COMPRESSION": str(opts.compression),
            "SIM_SLOW_RESPONSE_S": str(settings.http_read_timeout_s + 2),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update({f"SIM_{k.upper()}": str(v) for k, v in opts.faults.items()})
    env.update(run_settings_env(opts.lookup))
    log_path = checkout_dir() / "reports" / run_id / "processes.log"
    base_port = opts.base_port or free_port_block([0, *(100 + i for i in range(opts.workers))])
    procs = Processes(env, opts.workers, base_port, log_path)
    honcho = procs.start()
    print(f"processes started (honcho, logs: {log_path})", file=out)
    pool = await create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=2)
    pattern = f"{run_id}-%"
    try:
        await wait_healthy(f"{settings.remote_base_url.get_secret_value()}/healthz", 60, honcho, log_path)
        for port in procs.worker_ports():
            await wait_healthy(f"http://127.0.0.1:{port}/healthz", 120, honcho, log_path)
        # Measure the steady state: start the replay once every worker has its partitions (no start-up rebalance).
        if not await wait_group_stable(settings, opts.workers, 60):
            print("warning: the consumer group did not settle within 60 s; replaying anyway", file=out)
        started = time.monotonic()
        sent = [0]
        async with SubmissionProducer(settings) as producer:
            replay = asyncio.create_task(
                replay_trace(
                    producer,
                    rows,
                    trace=trace_name,
                    run_id=run_id,
                    compression=opts.compression,
                    model=settings.remote_model,
                    on_sent=lambda n: sent.__setitem__(0, n),
                )
            )
            deadline = started + opts.timeout_s
            while True:
                await asyncio.sleep(2.0)
                counts = await progress(pool, pattern)
                print(_line(counts, sent[0], len(rows), started, opts.lookup), file=out, flush=True)
                final = sum(n for s, n in counts.items() if s in FINAL_STATES)
                settled = not opts.lookup or counts.get("lookup_pending", 0) == 0
                if replay.done() and final >= len(rows) and settled and counts.get("outbox_pending", 0) == 0:
                    break
                if procs.proc is not None and procs.proc.poll() is not None:
                    raise MainJobError(f"worker processes exited; see the end of {log_path}:\n{tail(log_path)}")
                if time.monotonic() > deadline:
                    print(f"timeout after {opts.timeout_s:.0f} s: reporting what is there", file=out)
                    break
            ids = await replay
        elapsed = time.monotonic() - started
        report = await collect_report(
            settings,
            pool,
            pattern,
            ids,
            {
                "run_id": run_id,
                "workers": opts.workers,
                "partitions": opts.partitions,
                "trace": trace_name,
                "rows": len(rows),
                "start_row": opts.start,
                "compression": opts.compression,
                "faults": opts.faults,
                "lookup": opts.lookup,
                "wall_clock_s": round(elapsed, 1),
            },
        )
    finally:
        await pool.close()
        procs.stop()
    print(render_table(report), file=out)
    path = opts.report_path or (checkout_dir() / "reports" / run_id / "report.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"report written to {path}", file=out)
    return report


async def collect_report(
    settings: Settings, pool: asyncpg.Pool, pattern: str, ids: list[str], meta: dict[str, Any]
) -> dict[str, Any]:
    """Gather the independent records (ledger, simulator, Kafka read-back) and build the report."""
    rows = await pool.fetch(REPORT.run_operations, pattern)
    ledger = [
        LedgerOperation(
            r["operation_id"], r["state"], r["reason_code"], r["accepted_at_ms"], r["final_at_ms"], r["outputs"]
        )
        for r in rows
    ]
    async with httpx.AsyncClient(timeout=30.0) as client:
        sim = (await client.get(f"{settings.remote_base_url.get_secret_value()}/_sim/jobs")).json()["jobs"]
        summary = (await client.get(f"{settings.remote_base_url.get_secret_value()}/_sim/summary")).json()
    delivered = await read_topic_to_end(settings, "outputs_delivered")
    transitions = [
        (r["operation_id"], r["from_state"], r["to_state"]) for r in await pool.fetch(REPORT.run_transitions, pattern)
    ]
    accounting = await Ledger(pool, "report").accounting_summary(pattern)
    reconciled = await pool.fetchrow(REPORT.run_reconciled, pattern)
    meta = dict(meta)
    meta["faults_injected"] = summary.get("faults_injected", {})
    return build_report(
        submitted_ids=ids,
        ledger=ledger,
        sim_jobs=sim,
        delivered=[(d.value, d.timestamp_ms) for d in delivered],
        meta=meta,
        transitions=transitions,
        accounting=LedgerAccounting(
            reconciled=dict(reconciled) if reconciled is not None else {},
            duplicate_creations=accounting["duplicate_creations"],
            charges=accounting["charges"],
            refunds_settled=accounting["refunds_settled"],
            refunds_pending=accounting["refunds_pending"],
        ),
    )
