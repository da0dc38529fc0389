"""The benchmark's runs: the pipeline (worker processes), the floor and the naive peer, each on the same
closed-loop workload, each measured from independent records, then summarized (medians per configuration).

One run: its own ledger database and topics (created empty), the simulator's record reset, its processes
started and (for consumer groups) stable; the counters read; N submissions published at once; wait until every
operation is final and the outbox drained; the processes stopped; the counters read again; the report of the
main job (:func:`streams_harness.run.collect_report`) computed from the ledger, the simulator and Kafka.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson

from streams.clients.submit import SubmissionProducer
from streams.config import Settings
from streams.errors import error_summary
from streams.ledger.pool import create_pool
from streams.setup.admin import create_topics, database_name
from streams_harness.bench.counters import (
    Counters,
    kafka_messages,
    redis_counters,
    redis_reading_cost,
    settled_postgres_transactions,
)
from streams_harness.bench.procrastinate_peer import QUEUE_DATABASE_SUFFIX, apply_schema, queue_database_url
from streams_harness.bench.profile import Profiler, component_times, summarize
from streams_harness.bench.server_cpu import (
    ServerCpu,
    host_cpu_s,
    kafka_broker_pids,
    process_cpu_s,
    read_server_cpu,
    thread_cpu_ns,
    thread_wait_ns,
    threads_delta_s,
)
from streams_harness.bench.statements import (
    READER_ERRORS,
    STATEMENTS_UNREAD,
    Reading,
    StatementReader,
    changed_between,
    known_queries,
    open_reader,
    reader_error,
    statement_figures,
)
from streams_harness.cancels import callback_refusals, callback_secret
from streams_harness.checkout import checkout_dir
from streams_harness.fleet import Fleet, ProcessError, free_port, start_simulator, wait_healthy, worker_counter_sums
from streams_harness.redis_server import PrivateRedis
from streams_harness.replay import trace_request
from streams_harness.report import broken_promises
from streams_harness.run import collect_report, migrate_quietly, print_kept, progress, remove_run, settled
from streams_harness.services import create_run_database, drop_run_database, wait_group_stable
from streams_harness.trace import read_trace

PIPELINE, FLOOR, NAIVE, PACED = "pipeline", "floor", "naive", "paced"
#: The callbacks comparison: paced runs of long jobs, completion callbacks off and on (``RunSpec.callbacks``).
CALLBACKS = "callbacks"
#: Workers of a callbacks run: the simulator sends every callback to the first one.
CALLBACKS_WORKERS = 1
#: The job-queue peer (:mod:`streams_harness.bench.procrastinate_peer`).
PROCRASTINATE = "procrastinate"
#: The peers: what a team would run instead (held to the product's checks, never failing the benchmark).
PEERS = (NAIVE, PROCRASTINATE)

#: Configs of each run's own topics. ``segment.index.bytes``: a broker preallocates each new segment's offset and time
#: indexes at this size (10 MiB by default) as sparse files written through memory maps, and on a disk whose
#: ``read_ahead_kb`` is large the kernel reads ahead around each first touch of an index page, zeroing every page it
#: reads: on a run's fresh topics that was most of the broker's CPU (docs/benchmark.md, "The services' CPU"). A
#: topic in production meets it once per segment (1 GiB of log by default); a run's topics at every run. 1 MiB
#: indexes more than 300 MiB of log a segment (an entry per 4 KiB), more than a run writes to a partition.
RUN_TOPIC_CONFIGS = {"segment.index.bytes": str(1024 * 1024)}

#: Seconds the started processes are watched idle before the submissions, for ``idle_cpu_percent`` (each thread's
#: CPU to the nanosecond: :func:`~streams_harness.bench.server_cpu.thread_cpu_ns`): several rounds of a worker's
#: frequent timers (Faust's commit and keepalive, the fetcher's idle rounds); the 30 s ones (the relay's listening
#: fallback, Kafka's metadata refresh) fall in a third of the windows, a run-to-run difference.
IDLE_WINDOW_S = 10.0


@dataclass
class BenchOptions:
    """Options of ``streams bench`` (see its ``--help``)."""

    operations: int = 3000
    workers: tuple[int, ...] = (1, 2, 4)
    partitions: tuple[int, ...] = (4, 16)
    transports: tuple[str, ...] = ("aiohttp",)
    repeats: int = 1
    naive_processes: int = 2
    floor: bool = True
    #: Process counts of the floor's runs: ``ratio_to_floor`` divides by the one-process floor; more processes
    #: show what the machine allows more processes of any design (the pipeline's worker counts).
    floor_processes: tuple[int, ...] = (1, 2)
    naive: bool = True
    #: The job-queue peer, with ``naive_processes`` processes.
    procrastinate: bool = True
    sim_get_latency_ms: float = 0.0
    job_duration_ms: float = 0.0
    profile: bool = True
    report_path: Path | None = None
    chart_path: Path | None = None
    run_timeout_s: float = 300.0
    keep: bool = False
    paced_rate_per_s: float = 50.0
    paced_operations: int = 1000
    #: Two paced runs of jobs lasting several poll intervals, completion callbacks off then on
    #: (:func:`callbacks_comparison`); off by default: it adds two paced runs of long jobs.
    callbacks_comparison: bool = False
    callbacks_operations: int = 300
    callbacks_rate_per_s: float = 20.0
    #: Creation to completion of each job in the callbacks runs (ms).
    callbacks_job_duration_ms: float = 1000.0
    #: The simulator's longest poll hint in the callbacks runs (ms): without callbacks, a job is polled about
    #: this often until it ends.
    callbacks_poll_interval_ms: int = 200


@dataclass(frozen=True)
class RunSpec:
    """One run of the plan: what runs (``kind``), with how many processes and partitions, which transport."""

    kind: str
    processes: int
    partitions: int
    transport: str
    repeat: int
    profile: bool = False
    rate_per_s: float = 0.0  # PACED and CALLBACKS only: submissions per second (open loop)
    callbacks: bool = False  # CALLBACKS only: the workers take the simulator's completion callbacks

    @property
    def label(self) -> str:
        """The configuration's name (runs of one label are repeats of each other)."""
        if self.kind == FLOOR:
            return "floor" if self.processes == 1 else f"floor x{self.processes}"
        if self.kind in PEERS:
            return f"{self.kind} x{self.processes} p{self.partitions} {self.transport}"
        if self.kind == PACED:
            return f"paced {self.rate_per_s:g}/s w{self.processes} p{self.partitions}"
        if self.kind == CALLBACKS:
            return f"callbacks {'on' if self.callbacks else 'off'} w{self.processes} p{self.partitions}"
        return f"pipeline w{self.processes} p{self.partitions} {self.transport}"


def plan(opts: BenchOptions) -> list[RunSpec]:
    """The runs, repeat after repeat; every other repeat in reverse order (slow drifts of a shared machine
    then weigh on every configuration alike). Then, with ``profile``, extra runs under py-spy whose figures are
    left out of the summary (py-spy pauses the process for each sample and uses CPU of its own on the same
    cores): the floor with the fewest processes and the first pipeline configuration with the fewest workers,
    once per transport."""
    runs: list[RunSpec] = []
    for repeat in range(opts.repeats):
        batch: list[RunSpec] = []
        if opts.floor:
            for processes in opts.floor_processes:
                batch.append(RunSpec(FLOOR, processes, opts.partitions[0], "aiohttp", repeat))
        if opts.naive:
            batch.append(RunSpec(NAIVE, opts.naive_processes, opts.partitions[0], opts.transports[0], repeat))
        if opts.procrastinate:
            batch.append(RunSpec(PROCRASTINATE, opts.naive_processes, opts.partitions[0], opts.transports[0], repeat))
        for transport in opts.transports:
            for workers in opts.workers:
                for partitions in opts.partitions:
                    batch.append(RunSpec(PIPELINE, workers, partitions, transport, repeat))
        if opts.paced_rate_per_s > 0:  # delivery latency while not saturated: an open loop below capacity
            workers = 2 if 2 in opts.workers or not opts.workers else max(opts.workers)
            batch.append(
                RunSpec(
                    PACED, workers, opts.partitions[0], opts.transports[0], repeat, rate_per_s=opts.paced_rate_per_s
                )
            )
        if opts.callbacks_comparison:  # GETs and delivery latency of long jobs, callbacks off and on
            for on in (False, True):
                batch.append(
                    RunSpec(
                        CALLBACKS,
                        CALLBACKS_WORKERS,
                        opts.partitions[0],
                        opts.transports[0],
                        repeat,
                        rate_per_s=opts.callbacks_rate_per_s,
                        callbacks=on,
                    )
                )
        runs.extend(batch if repeat % 2 == 0 else reversed(batch))
    if opts.profile:  # extra runs under py-spy, after the measured ones: py-spy pauses the process it samples
        if opts.floor:
            runs.append(RunSpec(FLOOR, min(opts.floor_processes), opts.partitions[0], "aiohttp", 0, profile=True))
        for transport in opts.transports if opts.workers else ():
            runs.append(RunSpec(PIPELINE, min(opts.workers), opts.partitions[0], transport, 0, profile=True))
    return runs


class Bench:
    """The benchmark's shared pieces (private Redis, simulator) and its runs."""

    def __init__(self, opts: BenchOptions, out: Any = sys.stdout) -> None:
        self.opts = opts
        self.out = out
        self.base = Settings.from_env()
        self.bench_id = f"bench{int(time.time())}"
        self.dir = checkout_dir() / "reports" / self.bench_id
        self.dir.mkdir(parents=True, exist_ok=True)
        # A Redis server of the benchmark's own, so that its counters hold the measured programs' commands only;
        # without a redis-server binary, the environment's (its counters then include every other client's).
        self.redis = PrivateRedis(self.dir) if PrivateRedis.available() else None
        self.redis_url = self.base.redis_url.get_secret_value()
        self.sim_url = ""
        self.reading_cost = Counters(0, {}, 0)
        self.rows = read_trace(
            "conv", start=0, rows=max(opts.operations, opts.paced_operations, opts.callbacks_operations)
        )
        #: The Standard Webhooks secret of the callbacks runs (``whsec_<base64>``, never printed).
        self.callback_secret = callback_secret()
        #: The simulator's config as started (what a callbacks run changes is set back to it).
        self.sim_config: dict[str, Any] = {}
        self._seq = 0
        self.sim_pid = 0
        #: The brokers of the bootstrap address on this host (empty: Kafka's CPU is not counted, its figure null).
        self.kafka_pids = kafka_broker_pids(self.base.kafka_bootstrap)
        #: Why PostgreSQL's statement profile cannot be read (None while it can).
        self.statements_unavailable: str | None = None
        self.query_names = known_queries()

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    async def run(self) -> list[dict[str, Any]]:
        """Run the plan; returns one record per run (see :meth:`run_one`)."""
        if self.redis is not None:
            await self.redis.start()
            self.redis_url = self.redis.url
        self.reading_cost = await redis_reading_cost(self.redis_url)
        sim_port = free_port()
        self.sim_url = f"http://127.0.0.1:{sim_port}"
        sim_env = {
            "SIM_SEED": "7",
            "SIM_COMPRESSION": "1",
            "SIM_QUEUE_MS": str(self.opts.job_duration_ms),
            "SIM_PREFILL_MS_PER_TOKEN": "0",
            "SIM_DECODE_MS_PER_TOKEN": "0",
            "SIM_GET_LATENCY_MS": str(self.opts.sim_get_latency_ms),
            "SIM_MULTI_OUTPUT_RATE": "0",
        }
        sim = start_simulator(sim_port, self.dir / "simulator.log", sim_env)
        self.sim_pid = sim.pid
        records: list[dict[str, Any]] = []
        try:
            await wait_healthy(f"{self.sim_url}/healthz", 60, sim, self.dir / "simulator.log")
            self.sim_config = await self._configure_simulator({})
            specs = plan(self.opts)
            for i, spec in enumerate(specs, 1):
                how = (
                    "profiled: py-spy attached, left out of the figures"
                    if spec.profile
                    else f"repeat {spec.repeat + 1}"
                )
                self.say(f"[{i}/{len(specs)}] {spec.label} ({how})")
                record = await self.run_one(spec)
                records.append(record)
                self.say(
                    f"        {record['operations_per_s']:8.1f} ops/s  {record['gets_per_operation']:.2f} GET/op  "
                    f"{record['wall_clock_s']:.0f} s"
                    + (
                        f"  TIMED OUT ({record['operations_final']}/{record['operations']} final)"
                        if record["timed_out"]
                        else ""
                    )
                )
        finally:
            sim.terminate()
            sim.wait(10)
            if self.redis is not None:
                self.redis.stop()
        return records

    async def _configure_simulator(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply ``changes`` to the simulator's config (``POST /_sim/config``); returns its whole config."""
        async with httpx.AsyncClient(base_url=self.sim_url, timeout=30) as sim:
            answer = await sim.post("/_sim/config", json=changes)
            answer.raise_for_status()
            config: dict[str, Any] = answer.json()
            return config

    def _settings(self, spec: RunSpec, run_id: str, database_url: str) -> Settings:
        app_id = f"{self.base.app_id}-{run_id}" + (f"-{spec.kind}" if spec.kind in PEERS else "")
        settings = self.base.replace(
            database_url=database_url,
            topic_prefix=f"{self.base.topic_prefix}{run_id}.",
            app_id=app_id,
            lease_key_prefix=run_id,
            partitions=spec.partitions,
            redis_url=self.redis_url,
            remote_base_url=self.sim_url,
            http_transport=spec.transport,
            callbacks_enabled=False,
        )
        if spec.callbacks:  # the product's fallback interval: the bench loses no callback
            return settings.replace(callbacks_enabled=True, callback_secrets=self.callback_secret, web_enabled=True)
        return settings

    async def run_one(self, spec: RunSpec) -> dict[str, Any]:
        """One run (see the module docstring); returns its record of figures."""
        self._seq += 1
        run_id = f"{self.bench_id}r{self._seq}"
        log_dir = self.dir / f"{self._seq:02d}-{spec.label.replace(' ', '-')}"
        log_dir.mkdir(parents=True, exist_ok=True)
        admin_url = self.base.database_url.get_secret_value()
        database_url = await create_run_database(admin_url, run_id)
        settings = self._settings(spec, run_id, database_url)
        queue_url = queue_database_url(database_url) if spec.kind == PROCRASTINATE else None
        try:
            migrate_quietly(database_url)
            if queue_url is not None:
                await create_run_database(database_url, QUEUE_DATABASE_SUFFIX)
                await apply_schema(queue_url)
            await create_topics(settings, topic_configs=RUN_TOPIC_CONFIGS)
            async with httpx.AsyncClient(base_url=self.sim_url, timeout=30) as sim:
                (await sim.post("/_sim/reset")).raise_for_status()
            return await self._measure(spec, settings, run_id, log_dir)
        finally:
            if spec.kind == CALLBACKS:  # the next runs' jobs as the simulator started
                await self._configure_simulator(
                    {k: self.sim_config[k] for k in ("queue_ms", "poll_max_ms", "callback_url")}
                )
            if self.opts.keep:
                print_kept(settings, self.out)
                if queue_url is not None:
                    self.say(f"kept: procrastinate's database {database_name(queue_url)}")
            else:
                if queue_url is not None:
                    await _drop_quietly(admin_url, queue_url, self.out)
                await remove_run(settings, admin_url, self.out)

    def _statements_failed(self, exc: BaseException) -> None:
        """No statement profile from now on: say why, once."""
        self.statements_unavailable = reader_error(exc)
        self.say(f"        (no statement profile: pg_stat_statements: {self.statements_unavailable})")

    async def _open_statements(self, spec: RunSpec, settings: Settings) -> StatementReader | None:
        """A reader of the run's statements (:func:`open_reader`), or None once the profile is unavailable."""
        if self.statements_unavailable is not None:
            return None
        try:
            return await open_reader(
                settings.database_url.get_secret_value(), self._databases(spec, settings), self.query_names
            )
        except READER_ERRORS as exc:
            self._statements_failed(exc)
            return None

    async def _read_statements(self, reader: StatementReader | None) -> Reading | None:
        if reader is None or self.statements_unavailable is not None:
            return None
        try:
            return await reader.read()
        except READER_ERRORS as exc:
            self._statements_failed(exc)
            return None

    async def _start(self, spec: RunSpec, settings: Settings, log_dir: Path) -> Fleet:
        python = sys.executable
        if spec.kind in (PIPELINE, PACED, CALLBACKS):
            fleet = Fleet(settings, log_dir)
            for _ in range(spec.processes):
                fleet.start()
            await fleet.wait_ready()
            await wait_group_stable(settings, spec.processes, 60)
            if spec.kind == CALLBACKS:  # long jobs, short poll hints; with callbacks, sent to the first worker
                url = f"{fleet.live()[0].url}{settings.callback_path}" if spec.callbacks else ""
                await self._configure_simulator(
                    {
                        "queue_ms": self.opts.callbacks_job_duration_ms,
                        "poll_max_ms": self.opts.callbacks_poll_interval_ms,
                        "callback_url": url,
                        "callback_secret": self.callback_secret,
                    }
                )
        elif spec.kind in PEERS:
            module = {NAIVE: "naive", PROCRASTINATE: "procrastinate_peer"}[spec.kind]
            fleet = Fleet(settings, log_dir, command=[python, "-m", f"streams_harness.bench.{module}"])
            for _ in range(spec.processes):
                fleet.start()
            await wait_group_stable(settings, spec.processes, 60)
        else:
            ready = log_dir / "ready"
            ready.mkdir(exist_ok=True)
            command = [python, "-m", "streams_harness.bench.floor", "--ready-dir", str(ready)]
            fleet = Fleet(settings, log_dir, command=command)
            floors = [fleet.start() for _ in range(spec.processes)]  # one consumer group: they share the partitions
            deadline = time.monotonic() + 60
            while len(list(ready.iterdir())) < spec.processes:
                if not all(floor.alive() for floor in floors) or time.monotonic() > deadline:
                    raise ProcessError(f"the floor did not start; see {log_dir}")
                await asyncio.sleep(0.1)
            await wait_group_stable(settings, spec.processes, 60)
        return fleet

    def _databases(self, spec: RunSpec, settings: Settings) -> list[str]:
        """The names of the run's databases: the ledger's, and procrastinate's for its peer."""
        database_url = settings.database_url.get_secret_value()
        names = [database_name(database_url)]
        if spec.kind == PROCRASTINATE:
            names.append(database_name(queue_database_url(database_url)))
        return names

    async def _counters(self, spec: RunSpec, settings: Settings) -> Counters:
        reads, calls = await redis_counters(self.redis_url)
        admin_url = self.base.database_url.get_secret_value()
        transactions = 0
        for name in self._databases(spec, settings):
            transactions += await settled_postgres_transactions(admin_url, name)
        return Counters(reads, calls, transactions, await kafka_messages(settings))

    async def _server_cpu(self, spec: RunSpec, settings: Settings) -> ServerCpu:
        redis_pid = self.redis.proc.pid if self.redis is not None and self.redis.proc is not None else None
        return await read_server_cpu(
            self.base.database_url.get_secret_value(), self._databases(spec, settings), redis_pid, self.kafka_pids
        )

    async def _measure(self, spec: RunSpec, settings: Settings, run_id: str, log_dir: Path) -> dict[str, Any]:
        n = self._operations(spec)
        pattern = f"{run_id}-%"
        started = time.monotonic()
        fleet = await self._start(spec, settings, log_dir)
        profiler: Profiler | None = None
        reader: StatementReader | None = None
        statements_before: Reading | None = None
        statements_after: Reading | None = None
        progress_queries = 0
        timed_out = False
        try:
            # prepared here, before the counters' first reading: each of its two readings is then one transaction
            reader = await self._open_statements(spec, settings)
            pids = [worker.pid for worker in fleet.live()]
            idle_cpu_percent = await idle_percent(pids)  # before py-spy attaches: sampling costs a process CPU
            if spec.profile:
                profiler = Profiler(fleet.live()[0].pid, log_dir / "profile.txt")
                if not profiler.start():
                    self.say("        (py-spy is not installed: no profile)")
                    profiler = None
                elif not await profiler.sampling():  # attached before the run's readings, not during them
                    self.say("        (py-spy did not attach within 10 s: the profile may miss the start)")
            # after the idle window: what the processes did idle (the floor's polling rounds) is not the run's
            before = await self._counters(spec, settings)
            notifications_before = await listener_notifications(fleet.live())
            cpu_before = sum(process_cpu_s(pid) for pid in pids)
            waits_before = _waits_ns(pids)
            profiled_cpu_before = process_cpu_s(profiler.pid) if profiler is not None else None
            profiled_wait_before = _waits_ns([profiler.pid]) if profiler is not None else None
            sim_cpu_before = process_cpu_s(self.sim_pid)
            servers_before = await self._server_cpu(spec, settings)
            host_before = (time.monotonic(), host_cpu_s())
            statements_before = await self._read_statements(reader)
            ids = await self._submit(settings, run_id, n, spec.rate_per_s)
            conn = await asyncpg.connect(settings.database_url.get_secret_value())
            try:
                deadline = time.monotonic() + self.opts.run_timeout_s
                while True:
                    await asyncio.sleep(0.25)
                    progress_queries += 1
                    if settled(await progress(conn, pattern), n, lookup=False, outbox=spec.kind not in PEERS):
                        break
                    if not fleet.live():
                        raise ProcessError(f"the processes of {spec.label} exited; see {log_dir}")
                    if time.monotonic() > deadline:
                        timed_out = True
                        break
            finally:
                await conn.close()
            cpu_s = sum(process_cpu_s(pid) for pid in pids) - cpu_before
            wait_s = _waited_s(waits_before, pids)
            # the profiled process's own CPU and wait, unknown (None) when it exited during the run
            profiled_alive = profiler is not None and profiler.pid in [worker.pid for worker in fleet.live()]
            profiled_cpu_s = (
                process_cpu_s(profiler.pid) - profiled_cpu_before
                if profiler is not None and profiled_cpu_before is not None and profiled_alive
                else None
            )
            profiled_wait_s = (
                _waited_s(profiled_wait_before, [profiler.pid]) if profiler is not None and profiled_alive else None
            )
            # the workers' refusals by reason, while they answer /metrics
            refused = await callback_refusals([w.url for w in fleet.live()]) if spec.callbacks else {}
            notifications = await listener_notifications(fleet.live()) - notifications_before
            sim_cpu_s = process_cpu_s(self.sim_pid) - sim_cpu_before
            # read while the measured processes still hold their connections (a backend gone is not counted)
            servers_s = (await self._server_cpu(spec, settings)).minus(servers_before)
            host_s, host_wall_s = host_cpu_s() - host_before[1], time.monotonic() - host_before[0]
            statements_after = await self._read_statements(reader)
        finally:
            if profiler is not None:
                profiler.stop()
            fleet.stop_all()
            if reader is not None:
                await reader.close()
        after = await self._counters(spec, settings)
        cost = after.minus(before, self.reading_cost)
        # the progress queries: one transaction each, and one more for preparing the statement; the statement
        # profile's readings: one each (prepared before the first reading of the counters)
        readings = (statements_before is not None) + (statements_after is not None)
        cost = Counters(
            cost.redis_reads,
            cost.redis_calls,
            cost.postgres_transactions - progress_queries - 1 - readings,
            cost.kafka_messages,
        )
        pool = await create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=2)
        try:
            report = await collect_report(settings, pool, pattern, ids, {"run_id": run_id})
        finally:
            await pool.close()
        async with httpx.AsyncClient(base_url=self.sim_url, timeout=30) as sim:
            summary = (await sim.get("/_sim/summary")).json()
        record = figures(spec, report, summary, cost, n)
        record["rate_per_s"] = spec.rate_per_s
        record["postgres_notifications_per_operation"] = round(notifications / n, 2)
        record.update(self._statement_figures(spec, statements_before, statements_after, n))
        if spec.kind == CALLBACKS:
            record["callbacks_enabled"] = spec.callbacks
            record["job_duration_ms"] = self.opts.callbacks_job_duration_ms
            record["poll_interval_ms"] = self.opts.callbacks_poll_interval_ms
            record["callbacks"] = callback_figures(summary.get("callbacks"), report.get("callbacks"), refused)
        record["cpu_ms_per_operation"] = round(1000.0 * cpu_s / n, 3)
        record["runqueue_wait_ms_per_operation"] = None if wait_s is None else round(1000.0 * wait_s / n, 3)
        record["idle_cpu_percent"] = round(idle_cpu_percent, 2)
        record["idle_cpu_percent_per_process"] = round(idle_cpu_percent / len(pids), 2)
        record["simulator_cpu_ms_per_operation"] = round(1000.0 * sim_cpu_s / n, 3)
        record.update(
            server_cpu_figures(servers_s, n, redis_counted=self.redis is not None, kafka_counted=bool(self.kafka_pids))
        )
        record["host_cpu_ms_per_operation"] = round(1000.0 * host_s / n, 3)
        record["host_busy_cores"] = round(host_s / host_wall_s, 2) if host_wall_s > 0 else None
        record.update({"run_id": run_id, "timed_out": timed_out, "wall_clock_s": round(time.monotonic() - started, 1)})
        if profiler is not None and profiler.path.exists():
            profile = summarize(profiler.path)
            profiled_ms = round(1000.0 * profiled_cpu_s / n, 3) if profiled_cpu_s is not None else None
            waited_ms = round(1000.0 * profiled_wait_s / n, 3) if profiled_wait_s is not None else None
            record["profile"] = {
                "path": str(profiler.path),
                "processes": spec.processes,
                "cpu_ms_per_operation": profiled_ms,
                "runqueue_wait_ms_per_operation": waited_ms,
                # CPU plus wait; CPU alone where the kernel keeps no schedstat (the wait is null then)
                "active_ms_per_operation_by_component": (
                    component_times(profile, profiled_ms + (waited_ms or 0.0)) if profiled_ms is not None else {}
                ),
                **profile,
            }
        return record

    def _statement_figures(
        self, spec: RunSpec, before: Reading | None, after: Reading | None, n: int
    ) -> dict[str, object]:
        if before is None or after is None:
            return STATEMENTS_UNREAD
        changed = changed_between(before, after)
        if changed is not None:
            self.say(f"        (no statement profile for {spec.label}: pg_stat_statements: {changed})")
            return STATEMENTS_UNREAD
        return statement_figures(before.statements, after.statements, n)

    def _operations(self, spec: RunSpec) -> int:
        if spec.kind == CALLBACKS:
            return self.opts.callbacks_operations
        return self.opts.paced_operations if spec.kind == PACED else self.opts.operations

    async def _submit(self, settings: Settings, run_id: str, n: int, rate_per_s: float) -> list[str]:
        """Submit the first ``n`` trace rows: all at once (closed loop), or ``rate_per_s`` a second (open loop)."""
        ids: list[str] = []
        started = time.monotonic()
        async with SubmissionProducer(settings) as producer:
            futures = []
            for i, row in enumerate(self.rows[:n]):
                if rate_per_s > 0:
                    await asyncio.sleep(max(0.0, started + i / rate_per_s - time.monotonic()))
                operation_id = f"{run_id}-{i:06d}"
                request = trace_request(row, settings.remote_model)
                futures.append(await producer.submit(operation_id, request, {"bench": run_id, "row": row.row}))
                ids.append(operation_id)
            await asyncio.gather(*futures)
        return ids


async def _drop_quietly(admin_url: str, database_url: str, out: Any) -> None:
    """Drop a run's database; a failure is printed to ``out`` with what to remove by hand, never raised."""
    try:
        await drop_run_database(admin_url, database_url)
    except Exception as exc:
        name = database_name(database_url)
        print(f"warning: the run's database {name} not removed ({error_summary(exc)}); drop it by hand", file=out)


def callback_figures(
    sim: dict[str, Any] | None, recorded: dict[str, Any] | None, refused_by_reason: dict[str, int]
) -> dict[str, int]:
    """A run's callbacks: ``sent`` (the simulator's delivery attempts), ``acknowledged`` (answered 2xx),
    ``received`` (deliveries the ledger recorded), ``made_due`` (of those, the ones that made a poll due) and
    ``refused`` (the workers' refusals, every reason), from the simulator's ``callbacks`` of ``GET /_sim/summary``
    (``sim``, None: none sent), the report's ``callbacks`` (``recorded``, None: none sent) and the workers'
    ``streams_callbacks_refused_total`` by reason; all 0 when none was sent."""
    sim = sim or {}
    recorded = recorded or {}
    return {
        "sent": int(sim.get("attempts", 0)),
        "acknowledged": int(sim.get("acknowledged", 0)),
        "received": int(recorded.get("received", 0)),
        "made_due": int(recorded.get("made_due", 0)),
        "refused": sum(refused_by_reason.values()),
    }


def server_cpu_figures(
    servers_s: dict[str, float], n: int, *, redis_counted: bool, kafka_counted: bool = True
) -> dict[str, float | None]:
    """A run's CPU of the services per operation, in ms, from the seconds each spent (``postgres``, ``redis``,
    ``kafka``, see :mod:`streams_harness.bench.server_cpu`); Redis's is None without the benchmark's own server,
    Kafka's without a broker of the bootstrap address found on this host."""
    postgres = round(1000.0 * servers_s["postgres"] / n, 3)
    redis = round(1000.0 * servers_s["redis"] / n, 3) if redis_counted else None
    kafka = round(1000.0 * servers_s["kafka"] / n, 3) if kafka_counted else None
    return {
        "postgres_backends_cpu_ms_per_operation": postgres,
        "redis_server_cpu_ms_per_operation": redis,
        "kafka_broker_cpu_ms_per_operation": kafka,
    }


#: The workers' counter of outbox notifications their listeners read (streams.metrics).
NOTIFICATIONS_METRIC = "streams_ledger_notifications_total"


def _waits_ns(pids: list[int]) -> list[dict[int, int]] | None:
    """Each process's threads' run-queue waits so far (:func:`~streams_harness.bench.server_cpu.thread_wait_ns`);
    None on a kernel that keeps no ``schedstat``."""
    try:
        return [thread_wait_ns(pid) for pid in pids]
    except FileNotFoundError:
        return None


def _waited_s(before: list[dict[int, int]] | None, pids: list[int]) -> float | None:
    """Seconds the processes ``pids`` waited for a core since :func:`_waits_ns` read ``before``: None when it could
    not, or when one of them is gone (its wait went with it). A thread of a live process that ended meanwhile is
    not counted (:func:`~streams_harness.bench.server_cpu.threads_delta_s`)."""
    after = _waits_ns(pids)
    if before is None or after is None or any(not threads for threads in after):
        return None
    return sum(threads_delta_s(b, a) for b, a in zip(before, after, strict=True))


async def idle_percent(pids: list[int], window_s: float = IDLE_WINDOW_S) -> float:
    """Percent of one core the processes ``pids`` used together over ``window_s`` seconds from now, to the
    nanosecond (:func:`~streams_harness.bench.server_cpu.thread_cpu_ns`, a thread that ends meanwhile not counted);
    in clock ticks (10 ms) on a kernel that keeps no ``schedstat``."""
    started = time.monotonic()
    try:
        before = [thread_cpu_ns(pid) for pid in pids]
    except FileNotFoundError:
        ticks_before = sum(process_cpu_s(pid) for pid in pids)
        await asyncio.sleep(window_s)
        return 100.0 * (sum(process_cpu_s(pid) for pid in pids) - ticks_before) / (time.monotonic() - started)
    await asyncio.sleep(window_s)
    used_s = sum(threads_delta_s(b, thread_cpu_ns(pid)) for b, pid in zip(before, pids, strict=True))
    return 100.0 * used_s / (time.monotonic() - started)


async def listener_notifications(workers: Iterable[Any]) -> int:
    """Outbox notifications the listeners of ``workers`` (fleet processes with a ``url``) have read so far, from
    their ``/metrics`` (0 for a process without the metric: the floor and the peers)."""
    return sum((await worker_counter_sums([w.url for w in workers], NOTIFICATIONS_METRIC, "kind")).values())


def figures(spec: RunSpec, report: dict[str, Any], sim: dict[str, Any], cost: Counters, n: int) -> dict[str, Any]:
    """A run's record: throughput from the ledger, calls per operation from the simulator's record and the
    services' counters (field names in docs/benchmark.md)."""
    throughput = float(report["throughput_ops_per_s"])
    final = int(report["operations_final"])
    span_s = final / throughput if throughput else 0.0
    gets = int(sim["gets"])
    observations = max(1, gets)
    kafka_total = sum(cost.kafka_messages.values())
    return {
        "label": spec.label,
        "kind": spec.kind,
        "processes": spec.processes,
        "partitions": spec.partitions,
        "transport": spec.transport,
        "repeat": spec.repeat,
        "profiled": spec.profile,
        "operations": n,
        "operations_final": final,
        "operations_per_s": round(throughput, 1),
        "observations_per_s": round(gets / span_s, 1) if span_s else 0.0,
        "completion_to_delivery_ms": report["completion_to_delivery_ms"],
        "completion_to_delivery_split_ms": report.get("completion_to_delivery_split_ms", {}),
        "posts_per_operation": round(int(sim["posts"]) / n, 3),
        "gets_per_operation": round(gets / n, 3),
        "gets_per_completed_operation": report.get("gets_per_completed_operation", {}).get("mean"),
        "max_gets_in_flight_per_job": int(sim["max_gets_in_flight_per_job"]),
        "max_jobs_per_operation": int(sim["max_jobs_per_operation"]),
        "output_duplicates": report["output_duplicates"],
        "redis_round_trips_per_observation": round(cost.redis_reads / observations, 2),
        "redis_round_trips_per_operation": round(cost.redis_reads / n, 2),
        "redis_calls_per_observation": {k: round(v / observations, 2) for k, v in sorted(cost.redis_calls.items())},
        "postgres_round_trips_per_operation": round(cost.postgres_transactions / n, 2),
        "kafka_messages_per_operation": round(kafka_total / n, 2),
        "kafka_messages_by_topic": cost.kafka_messages,
        # The product's promises, checked for the pipeline and for the peers (what a team would run instead:
        # which of them they keep); the floor records no charges and makes none, so its is None.
        "broken_promises": broken_promises(report, repeats_allowed=False) if spec.kind != FLOOR else None,
    }


#: Figures summarized as medians over a configuration's repeats.
MEDIAN_FIELDS = (
    "operations_per_s",
    "cpu_ms_per_operation",
    "idle_cpu_percent",
    "idle_cpu_percent_per_process",
    "simulator_cpu_ms_per_operation",
    "observations_per_s",
    "posts_per_operation",
    "gets_per_operation",
    "max_gets_in_flight_per_job",
    "redis_round_trips_per_observation",
    "redis_round_trips_per_operation",
    "postgres_round_trips_per_operation",
    "kafka_messages_per_operation",
)

#: Figures summarized as medians of the runs that have them (None: not measured in any).
OPTIONAL_MEDIAN_FIELDS = (
    "postgres_backends_cpu_ms_per_operation",
    "redis_server_cpu_ms_per_operation",
    "kafka_broker_cpu_ms_per_operation",
    "runqueue_wait_ms_per_operation",
    "postgres_statements_per_operation",
    "postgres_exec_ms_per_operation",
    "host_cpu_ms_per_operation",
    "host_busy_cores",
)


#: The shares of ``completion_to_delivery_split_ms`` (:func:`streams_harness.report.delivery_split`).
SPLIT_SHARES = ("poll_schedule", "pipeline")


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def summarize_runs(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Label -> medians of :data:`MEDIAN_FIELDS` and of the delivery percentiles over the label's runs, with
    ``runs`` (how many), ``operations_per_s_runs`` (each run's figure) and ``profiled`` (any run profiled)."""
    by_label: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_label.setdefault(record["label"], []).append(record)
    summary: dict[str, dict[str, Any]] = {}
    for label, runs in by_label.items():
        entry: dict[str, Any] = {k: runs[0][k] for k in ("kind", "processes", "partitions", "transport")}
        entry["runs"] = len(runs)
        entry["operations_per_s_runs"] = [r["operations_per_s"] for r in runs]
        for name in MEDIAN_FIELDS:
            entry[name] = _median([float(r[name]) for r in runs])
        for name in OPTIONAL_MEDIAN_FIELDS:
            present = [float(r[name]) for r in runs if r.get(name) is not None]
            entry[name] = _median(present) if present else None
        for pct in ("p50", "p99"):
            values = [
                float(r["completion_to_delivery_ms"][pct])
                for r in runs
                if r["completion_to_delivery_ms"][pct] is not None
            ]
            entry.setdefault("completion_to_delivery_ms", {})[pct] = _median(values) if values else None
            for share in SPLIT_SHARES:
                values = [
                    float(r["completion_to_delivery_split_ms"][share][pct])
                    for r in runs
                    if r.get("completion_to_delivery_split_ms", {}).get(share, {}).get(pct) is not None
                ]
                split = entry.setdefault("completion_to_delivery_split_ms", {}).setdefault(share, {})
                split[pct] = _median(values) if values else None
        done = [
            float(r["gets_per_completed_operation"]) for r in runs if r.get("gets_per_completed_operation") is not None
        ]
        entry["gets_per_completed_operation"] = _median(done) if done else None
        if "callbacks" in runs[0]:  # the callbacks comparison's runs
            entry["callbacks_enabled"] = runs[0]["callbacks_enabled"]
            entry["callbacks"] = {k: _median([float(r["callbacks"][k]) for r in runs]) for k in runs[0]["callbacks"]}
        promises = [r["broken_promises"] for r in runs]
        entry["broken_promises"] = None if None in promises else sorted({p for found in promises for p in found})
        summary[label] = entry
    return summary


@dataclass
class Comparison:
    """The headline ratios (see :func:`compare`)."""

    ratio_to_floor: dict[str, float] = field(default_factory=dict)
    gets_ratio_to_naive: dict[str, float] = field(default_factory=dict)


def compare(summary: dict[str, dict[str, Any]]) -> Comparison:
    """Each pipeline configuration's median throughput over the one-process floor's, and its GETs per operation
    over the naive peer's (below 1: the GETs the lease saves)."""
    result = Comparison()
    floors = [s for s in summary.values() if s["kind"] == FLOOR]
    floor = next((s for s in floors if s["processes"] == 1), floors[0] if floors else None)
    naive = next((s for s in summary.values() if s["kind"] == NAIVE), None)
    for label, entry in summary.items():
        if entry["kind"] != PIPELINE:
            continue
        if floor is not None and floor["operations_per_s"]:
            result.ratio_to_floor[label] = round(entry["operations_per_s"] / floor["operations_per_s"], 3)
        if naive is not None and naive["gets_per_operation"]:
            result.gets_ratio_to_naive[label] = round(entry["gets_per_operation"] / naive["gets_per_operation"], 3)
    return result


def callbacks_comparison(
    summary: dict[str, dict[str, Any]], job_duration_ms: float, poll_interval_ms: int
) -> dict[str, Any] | None:
    """The report's ``callbacks_comparison`` from the summary's callbacks runs (medians over repeats): the jobs'
    ``job_duration_ms`` and the simulator's longest poll hint ``poll_interval_ms``, then under ``off`` and ``on``
    (each present when run) the run's ``label``, ``gets_per_completed_operation``, ``gets_per_operation``,
    ``completion_to_delivery_ms`` (``p50``, ``p99``) and ``callbacks`` (:func:`callback_figures`), and with both
    ``gets_ratio_on_to_off`` (GETs per completed operation with callbacks over without; None when without is 0 or
    unknown). None without a callbacks run."""
    runs = {
        ("on" if s["callbacks_enabled"] else "off"): (label, s)
        for label, s in summary.items()
        if s["kind"] == CALLBACKS
    }
    if not runs:
        return None
    result: dict[str, Any] = {"job_duration_ms": job_duration_ms, "poll_interval_ms": poll_interval_ms}
    for key in ("off", "on"):
        if key in runs:
            label, s = runs[key]
            result[key] = {
                "label": label,
                "gets_per_completed_operation": s["gets_per_completed_operation"],
                "gets_per_operation": s["gets_per_operation"],
                "completion_to_delivery_ms": s["completion_to_delivery_ms"],
                "callbacks": s["callbacks"],
            }
    if "off" in result and "on" in result:
        off, on = result["off"]["gets_per_completed_operation"], result["on"]["gets_per_completed_operation"]
        result["gets_ratio_on_to_off"] = round(on / off, 3) if off and on is not None else None
    return result


def render_callbacks(comparison: dict[str, Any]) -> str:
    """The callbacks comparison (:func:`callbacks_comparison`) as a fixed-width table."""
    columns = (("GET/done op", 11), ("c2d p50", 8), ("c2d p99", 8), ("sent", 6), ("received", 8), ("refused", 7))
    title = (
        f"callbacks: jobs of {comparison['job_duration_ms']:g} ms, "
        f"poll hints of at most {comparison['poll_interval_ms']} ms"
    )
    header = f"{'configuration':<28} " + " ".join(f"{name:>{width}}" for name, width in columns)
    lines = [title, header, "-" * len(header)]
    for key in ("off", "on"):
        row = comparison.get(key)
        if row is None:
            continue
        gets = row["gets_per_completed_operation"]
        cells = (
            "-" if gets is None else f"{gets:.2f}",
            _ms(row["completion_to_delivery_ms"]["p50"]),
            _ms(row["completion_to_delivery_ms"]["p99"]),
            f"{row['callbacks']['sent']:.0f}",
            f"{row['callbacks']['received']:.0f}",
            f"{row['callbacks']['refused']:.0f}",
        )
        lines.append(
            f"{row['label']:<28} "
            + " ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns, strict=True))
        )
    if comparison.get("gets_ratio_on_to_off") is not None:
        lines.append(f"GETs per completed operation, callbacks on over off: {comparison['gets_ratio_on_to_off']:.3f}")
    return "\n".join(lines)


def render_summary(summary: dict[str, dict[str, Any]], comparison: Comparison) -> str:
    """The summary as a fixed-width table (terminal and README)."""
    columns = (
        ("ops/s", 7),
        ("CPU ms/op", 9),
        ("wait ms/op", 10),
        ("PG CPU", 6),
        ("Redis CPU", 9),
        ("Kafka CPU", 9),
        ("host CPU", 8),
        ("cores", 5),
        ("idle%/proc", 10),
        ("obs/s", 7),
        ("c2d p50", 8),
        ("c2d p99", 8),
        ("poll p50", 8),
        ("pipe p50", 8),
        ("pipe p99", 8),
        ("POST/op", 7),
        ("GET/op", 7),
        ("GETs||", 6),
        ("Redis RT/obs", 12),
        ("PG RT/op", 8),
        ("Kafka/op", 8),
        ("x floor", 7),
    )
    header = f"{'configuration':<28} " + " ".join(f"{name:>{width}}" for name, width in columns)
    lines = [header, "-" * len(header)]
    for label, s in summary.items():
        c2d = s["completion_to_delivery_ms"]
        split = s.get("completion_to_delivery_split_ms", {})
        ratio = comparison.ratio_to_floor.get(label)
        cells = (
            f"{s['operations_per_s']:.1f}",
            f"{s['cpu_ms_per_operation']:.2f}",
            _cpu(s.get("runqueue_wait_ms_per_operation")),
            _cpu(s.get("postgres_backends_cpu_ms_per_operation")),
            _cpu(s.get("redis_server_cpu_ms_per_operation")),
            _cpu(s.get("kafka_broker_cpu_ms_per_operation")),
            _cpu(s.get("host_cpu_ms_per_operation")),
            _cpu(s.get("host_busy_cores")),
            f"{s['idle_cpu_percent_per_process']:.2f}",
            f"{s['observations_per_s']:.1f}",
            _ms(c2d["p50"]),
            _ms(c2d["p99"]),
            _ms(split.get("poll_schedule", {}).get("p50")),
            _ms(split.get("pipeline", {}).get("p50")),
            _ms(split.get("pipeline", {}).get("p99")),
            f"{s['posts_per_operation']:.2f}",
            f"{s['gets_per_operation']:.2f}",
            f"{s['max_gets_in_flight_per_job']:.0f}",
            f"{s['redis_round_trips_per_observation']:.2f}",
            f"{s['postgres_round_trips_per_operation']:.2f}",
            f"{s['kafka_messages_per_operation']:.2f}",
            "" if ratio is None else f"{ratio:.3f}",
        )
        lines.append(
            f"{label:<28} " + " ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns, strict=True))
        )
    broken = [(label, s["broken_promises"]) for label, s in summary.items() if s["broken_promises"]]
    kept = [label for label, s in summary.items() if s["broken_promises"] == []]
    if kept:
        lines.append("kept every promise checked: " + ", ".join(kept))
    for label, problems in broken:
        lines.append(f"broke: {label}: " + ", ".join(problems))
    return "\n".join(lines)


def _cpu(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


#: The CPU figures of :func:`scaling` summed into ``total_cpu_ms_per_operation`` (a service not measured adds 0).
CPU_FIELDS = (
    "cpu_ms_per_operation",
    "postgres_backends_cpu_ms_per_operation",
    "redis_server_cpu_ms_per_operation",
    "kafka_broker_cpu_ms_per_operation",
)


def scaling(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The pipeline's scaling with its worker count: per pipeline configuration (worker count order within each
    partition count and transport), CPU per operation (the workers', each service's and their sum), round trips
    per operation (PostgreSQL's plus Redis's) and both over the same partitions' and transport's one-worker run
    (None without one)."""
    rows: list[dict[str, Any]] = []
    pipelines = [(label, s) for label, s in summary.items() if s["kind"] == PIPELINE]
    pipelines.sort(key=lambda item: (item[1]["transport"], item[1]["partitions"], item[1]["processes"]))
    reference: dict[tuple[str, int], dict[str, float]] = {}
    for label, s in pipelines:
        total_cpu = round(sum(float(s.get(name) or 0.0) for name in CPU_FIELDS), 3)
        round_trips = round(
            float(s["postgres_round_trips_per_operation"]) + float(s["redis_round_trips_per_operation"]), 2
        )
        key = (s["transport"], s["partitions"])
        if s["processes"] == 1:
            reference[key] = {"cpu": total_cpu, "round_trips": round_trips}
        one = reference.get(key)
        rows.append(
            {
                "label": label,
                "workers": s["processes"],
                "partitions": s["partitions"],
                "transport": s["transport"],
                **{name: s.get(name) for name in CPU_FIELDS},
                "total_cpu_ms_per_operation": total_cpu,
                "total_cpu_ratio_to_one_worker": round(total_cpu / one["cpu"], 3) if one and one["cpu"] else None,
                "round_trips_per_operation": round_trips,
                "round_trips_ratio_to_one_worker": (
                    round(round_trips / one["round_trips"], 3) if one and one["round_trips"] else None
                ),
            }
        )
    return rows


def render_scaling(rows: list[dict[str, Any]]) -> str:
    """The scaling rows (:func:`scaling`) as a fixed-width table."""
    columns = (
        ("workers CPU", 11),
        ("PG CPU", 6),
        ("Redis CPU", 9),
        ("Kafka CPU", 9),
        ("CPU ms/op", 9),
        ("x w1", 6),
        ("RT/op", 6),
        ("x w1", 6),
    )
    header = f"{'scaling':<28} " + " ".join(f"{name:>{width}}" for name, width in columns)
    lines = [header, "-" * len(header)]
    for row in rows:
        cells = (
            _cpu(row["cpu_ms_per_operation"]),
            _cpu(row["postgres_backends_cpu_ms_per_operation"]),
            _cpu(row["redis_server_cpu_ms_per_operation"]),
            _cpu(row["kafka_broker_cpu_ms_per_operation"]),
            _cpu(row["total_cpu_ms_per_operation"]),
            _ratio(row["total_cpu_ratio_to_one_worker"]),
            f"{row['round_trips_per_operation']:.2f}",
            _ratio(row["round_trips_ratio_to_one_worker"]),
        )
        lines.append(
            f"{row['label']:<28} "
            + " ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns, strict=True))
        )
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write the report as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
