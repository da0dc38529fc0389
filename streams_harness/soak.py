"""The soak: replay N trace rows through several worker processes while injecting seeded random faults,
then audit the ledger against the simulator's own record: nothing may be lost or done twice.

Faults (each kind chosen by a seeded ``random.Random``):

==================== ==========================================================================
``worker_kill``      SIGKILL a worker; a replacement starts
``worker_pause``     SIGSTOP a worker for twice the lease TTL, then SIGCONT
``redis_restart``    ``scripts/services restart redis`` (a real restart, Redis comes back empty)
``kafka_restart``    ``scripts/services restart kafka``
``postgres_restart`` ``scripts/services restart postgres``
``latency``          Toxiproxy adds 300 ms (±100) to worker<->simulator traffic for 5 s
``drop_connections`` Toxiproxy resets worker<->simulator connections for 2 s
==================== ==========================================================================

Services that ``scripts/services`` does not manage (reused ones) are not restarted; such faults are
reported as skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from streams.admin import create_run_database, create_topics, delete_topics, drop_run_database, migrate
from streams.config import Settings
from streams.errors import StreamsError
from streams.ledger import create_pool
from streams.producer import SubmissionProducer
from streams_harness.checkout import checkout_dir
from streams_harness.fleet import Fleet, free_port, start_simulator
from streams_harness.mainjob import (
    DEFAULT_FAULTS,
    RUN_LOOKUP_LAG_S,
    collect_report,
    progress,
    run_settings_env,
)
from streams_harness.replay import replay_trace
from streams_harness.report import FINAL_STATES, render_table
from streams_harness.trace import read_trace

FAULT_KINDS = (
    "worker_kill",
    "worker_pause",
    "redis_restart",
    "kafka_restart",
    "postgres_restart",
    "latency",
    "drop_connections",
)
TOXIPROXY_API = "http://127.0.0.1:8474"


class SoakError(StreamsError):
    """The soak could not run (a process died, a tool is missing); the message says what and where."""


@dataclass
class SoakOptions:
    """Options of ``streams soak``."""

    trace: str = "conv"
    start: int = 0
    rows: int = 10_000
    compression: float = 15.0
    workers: int = 3
    faults: int = 20
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    seed: int = 1
    sim_faults: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_FAULTS))
    report_path: Path | None = None
    timeout_s: float = 1800.0
    lease_ttl_ms: int = 3000
    #: Keep the run's database and topics after the report.
    keep: bool = False
    #: Reconciliation delay for ``submitting`` without outcome; must exceed the POST retry budget below.
    submitting_stale_after_s: float = 60.0
    submit_retry_deadline_s: float = 30.0
    #: Reconcile uncertain operations by lookup of the client reference (the simulator offers it for the run);
    #: the audit then requires no uncertain operation whose job the provider created.
    lookup: bool = False
    #: A job that never finishes stalls this long after its id was saved (outages can delay observations).
    max_observation_age_s: float = 60.0


class Chaos:
    """Runs the seeded fault plan against the fleet, the services and the Toxiproxy proxy."""

    def __init__(self, opts: SoakOptions, fleet: Fleet, proxy: str, log: Any) -> None:
        self.opts = opts
        self.fleet = fleet
        self.proxy = proxy
        self.log = log
        self.rng = random.Random(opts.seed)
        self.injected: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()

    def plan(self, duration_s: float) -> list[tuple[float, str]]:
        """``faults`` (time offset in s, kind) pairs spread over ``duration_s``; every kind appears."""
        kinds: list[str] = []
        while len(kinds) < self.opts.faults:
            batch = list(self.opts.fault_kinds)
            self.rng.shuffle(batch)
            kinds.extend(batch)
        times = sorted(self.rng.uniform(1.0, max(2.0, duration_s)) for _ in range(self.opts.faults))
        return list(zip(times, kinds[: self.opts.faults], strict=True))

    async def run(self, plan: list[tuple[float, str]]) -> None:
        started = time.monotonic()
        for at_s, kind in plan:
            delay = started + at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            print(f"[chaos {time.monotonic() - started:6.1f}s] {kind}", file=self.log, flush=True)
            await getattr(self, kind)()

    async def worker_kill(self) -> None:
        live = self.fleet.live()
        victim = self.rng.choice(live)
        self.fleet.signal(victim, signal.SIGKILL)
        self.fleet.start()
        self.injected["worker_kill"] += 1

    async def worker_pause(self) -> None:
        victim = self.rng.choice(self.fleet.live())
        self.fleet.signal(victim, signal.SIGSTOP)
        self.injected["worker_pause"] += 1
        await asyncio.sleep(2 * self.opts.lease_ttl_ms / 1000.0 + 1.0)
        self.fleet.signal(victim, signal.SIGCONT)

    async def _restart(self, service: str) -> None:
        status = await asyncio.to_thread(
            subprocess.run, [str(checkout_dir() / "scripts" / "services"), "status"], capture_output=True, text=True
        )
        managed = any(line.startswith(service) and "managed," in line for line in status.stdout.splitlines())
        if not managed:
            self.skipped[f"{service}_restart"] += 1
            return
        await asyncio.to_thread(
            subprocess.run,
            [str(checkout_dir() / "scripts" / "services"), "restart", service],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        self.injected[f"{service}_restart"] += 1

    async def redis_restart(self) -> None:
        await self._restart("redis")

    async def kafka_restart(self) -> None:
        await self._restart("kafka")

    async def postgres_restart(self) -> None:
        await self._restart("postgres")

    async def _toxic(self, body: dict[str, Any], seconds: float) -> None:
        async with httpx.AsyncClient(base_url=TOXIPROXY_API, timeout=10) as c:
            (await c.post(f"/proxies/{self.proxy}/toxics", json=body)).raise_for_status()
            await asyncio.sleep(seconds)
            await c.delete(f"/proxies/{self.proxy}/toxics/{body['name']}")

    async def latency(self) -> None:
        self.injected["latency"] += 1
        await self._toxic(
            {
                "name": "latency",
                "type": "latency",
                "stream": "downstream",
                "attributes": {"latency": 300, "jitter": 100},
            },
            5.0,
        )

    async def drop_connections(self) -> None:
        self.injected["drop_connections"] += 1
        await self._toxic(
            {"name": "drop", "type": "reset_peer", "stream": "upstream", "attributes": {"timeout": 0}}, 2.0
        )


def _start_simulator(opts: SoakOptions, settings: Settings, port: int, log_dir: Path) -> subprocess.Popen[bytes]:
    sim_env = {
        "SIM_SEED": str(opts.seed),
        "SIM_COMPRESSION": str(opts.compression),
        "SIM_SLOW_RESPONSE_S": str(settings.http_read_timeout_s + 2),
    }
    sim_env.update({f"SIM_{k.upper()}": str(v) for k, v in opts.sim_faults.items()})
    sim_env.update({k: v for k, v in run_settings_env(opts.lookup).items() if k.startswith("SIM_")})
    return start_simulator(port, log_dir / "simulator.log", sim_env)


async def _toxiproxy(run_id: str, upstream_port: int) -> tuple[str, int]:
    """Start Toxiproxy (scripts/toxiproxy up) and create the worker->simulator proxy; returns (name, port)."""
    await asyncio.to_thread(subprocess.run, [str(checkout_dir() / "scripts" / "toxiproxy"), "up"], check=True)
    name, port = f"sim-{run_id}", free_port()
    async with httpx.AsyncClient(base_url=TOXIPROXY_API, timeout=10) as c:
        r = await c.post(
            "/proxies",
            json={
                "name": name,
                "listen": f"127.0.0.1:{port}",
                "upstream": f"127.0.0.1:{upstream_port}",
                "enabled": True,
            },
        )
        r.raise_for_status()
    return name, port


async def run_soak(opts: SoakOptions, out: Any = sys.stdout) -> dict[str, Any]:
    """Run the soak and return its report (printed as a table and written as JSON)."""
    checkout_dir()  # outside a clone, fail before anything is created
    run_id = f"soak{int(time.time())}"
    base = Settings.from_env()
    sim_port = free_port()
    rows = read_trace(opts.trace, start=opts.start, rows=opts.rows)
    log_dir = checkout_dir() / "reports" / run_id
    log_dir.mkdir(parents=True, exist_ok=True)
    # nothing of another run reaches this one
    run_db = await create_run_database(base.database_url.get_secret_value(), run_id)
    migrate(run_db)
    proxy, proxy_port = await _toxiproxy(run_id, sim_port)
    settings = base.replace(
        database_url=run_db,
        topic_prefix=f"{base.topic_prefix}{run_id}.",
        app_id=f"{base.app_id}-{run_id}",
        remote_account=run_id,  # the run's own simulator is its own provider account: its own rate budget
        remote_base_url=f"http://127.0.0.1:{proxy_port}",
        lease_ttl_ms=opts.lease_ttl_ms,
        remote_call_deadline_s=0.5 * opts.lease_ttl_ms / 1000.0,
        lease_margin_s=0.25 * opts.lease_ttl_ms / 1000.0,
        visibility_timeout_s=max(5.0, 2 * opts.lease_ttl_ms / 1000.0),
        kafka_session_timeout_s=10.0,
        kafka_heartbeat_interval_s=2.0,
        submitting_stale_after_s=opts.submitting_stale_after_s,
        submit_retry_deadline_s=opts.submit_retry_deadline_s,
        max_observation_age_s=opts.max_observation_age_s,
        lookup_enabled=opts.lookup,
        lookup_lag_s=RUN_LOOKUP_LAG_S + 1.0,
        web_enabled=True,
    )
    await create_topics(settings)
    sim = _start_simulator(opts, settings, sim_port, log_dir)
    fleet = Fleet(settings, log_dir)
    for _ in range(opts.workers):
        fleet.start()
    chaos = Chaos(opts, fleet, proxy, out)
    pool = await create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=2)
    pattern = f"{run_id}-%"
    print(
        f"soak {run_id}: {len(rows)} rows, {opts.workers} workers, {opts.faults} faults (seed {opts.seed}), "
        f"logs in {log_dir}",
        file=out,
    )
    try:
        started = time.monotonic()
        replay_s = rows[-1].arrival_s / opts.compression if rows else 0.0
        chaos_task = asyncio.create_task(chaos.run(chaos.plan(replay_s)))
        sent = [0]
        async with SubmissionProducer(settings) as producer:
            replay = asyncio.create_task(
                replay_trace(
                    producer,
                    rows,
                    trace=Path(opts.trace).stem,
                    run_id=run_id,
                    compression=opts.compression,
                    model=settings.remote_model,
                    on_sent=lambda n: sent.__setitem__(0, n),
                )
            )
            while True:
                await asyncio.sleep(5.0)
                with contextlib.suppress(Exception):  # PostgreSQL may be restarting right now
                    counts = await progress(pool, pattern)
                    final = sum(n for s, n in counts.items() if s in FINAL_STATES)
                    print(
                        f"[{time.monotonic() - started:6.1f}s] submitted {sent[0]}/{len(rows)} final {final} "
                        f"outbox pending {counts.get('outbox_pending', 0)} faults {dict(chaos.injected)}",
                        file=out,
                        flush=True,
                    )
                    settled = not opts.lookup or not counts.get("lookup_pending")
                    done = replay.done() and chaos_task.done() and final >= len(rows) and settled
                    if done and not counts.get("outbox_pending"):
                        break
                if sim.poll() is not None:
                    raise SoakError(f"the simulator exited; see {log_dir / 'simulator.log'}")
                if time.monotonic() - started > opts.timeout_s:
                    print(f"timeout after {opts.timeout_s:.0f} s: auditing what is there", file=out)
                    break
            ids = await replay
            if not chaos_task.done():
                chaos_task.cancel()
        report = await collect_report(
            settings,
            pool,
            pattern,
            ids,
            {
                "run_id": run_id,
                "workers": opts.workers,
                "partitions": settings.partitions,
                "trace": Path(opts.trace).stem,
                "rows": len(rows),
                "start_row": opts.start,
                "compression": opts.compression,
                "seed": opts.seed,
                "faults": opts.sim_faults,
                "lookup": opts.lookup,
                "wall_clock_s": round(time.monotonic() - started, 1),
            },
        )
        report["faults_by_kind"] = dict(chaos.injected)
        report["faults_skipped"] = dict(chaos.skipped)
    finally:
        await pool.close()
        fleet.stop_all()
        sim.terminate()
        sim.wait()
        with contextlib.suppress(Exception):
            async with httpx.AsyncClient(base_url=TOXIPROXY_API, timeout=10) as c:
                await c.delete(f"/proxies/{proxy}")
        if not opts.keep:
            with contextlib.suppress(Exception):
                await delete_topics(settings)
            with contextlib.suppress(Exception):
                await drop_run_database(base.database_url.get_secret_value(), run_db)
    print(render_table(report), file=out)
    path = opts.report_path or (log_dir / "report.json")
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"report written to {path}", file=out)
    return report
