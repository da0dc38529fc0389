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
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx

from streams.config import Settings
from streams.errors import StreamsError
from streams.ledger.pool import create_pool
from streams_harness.cancels import callback_secret
from streams_harness.checkout import checkout_dir
from streams_harness.fleet import Fleet, Worker, free_port, start_simulator
from streams_harness.run import (
    DEFAULT_FAULTS,
    RunOptions,
    RunSteps,
    collect_report,
    isolated_run,
    replay_until_final,
    run_cancellations,
    run_dir,
    run_meta,
    simulator_env,
    worker_settings,
    write_report,
)
from streams_harness.toxiproxy import Toxiproxy
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


#: The soak's callback fault rates (docs/callbacks.md), on top of its process and service faults.
SOAK_CALLBACK_FAULTS: dict[str, float] = {
    "callback_loss": 0.1,
    "callback_duplicates": 0.05,
    "callback_reorder": 0.1,
    "callback_bad_signature": 0.05,
}


class SoakError(StreamsError):
    """The soak could not run (a process died, a tool is missing); the message says what and where."""


@dataclass
class SoakOptions(RunOptions):
    """Options of ``streams soak``; the common ones are :class:`RunOptions`' (with the soak's defaults here)."""

    rows: int = 10_000
    workers: int = 3
    seed: int = 1
    timeout_s: float = 1800.0
    #: Faults to inject (the plan's length), of ``fault_kinds``.
    faults: int = 20
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    #: The simulator's fault rates (``fault_429``, ...).
    sim_faults: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_FAULTS))
    lease_ttl_ms: int = 3000
    #: Reconciliation delay for ``submitting`` without outcome; must exceed the POST retry budget below.
    submitting_stale_after_s: float = 60.0
    submit_retry_deadline_s: float = 30.0
    #: A job that never finishes stalls this long after its id was saved (outages can delay observations).
    max_observation_age_s: float = 60.0
    cancel_fraction: float = 0.03
    #: The soak's callback faults: more lost and badly signed deliveries than the main job's.
    callback_faults: dict[str, float] = field(default_factory=lambda: dict(SOAK_CALLBACK_FAULTS))


class Chaos:
    """Runs the seeded fault plan against the fleet, the services and the Toxiproxy proxy ``proxy``."""

    def __init__(self, opts: SoakOptions, fleet: Fleet, toxiproxy: Toxiproxy, proxy: str, log: TextIO) -> None:
        self.opts = opts
        self.fleet = fleet
        self.toxiproxy = toxiproxy
        self.proxy = proxy
        self.log = log
        self.rng = random.Random(opts.seed)
        self.injected: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        #: Names of the workers this plan killed (the others must not exit before the end).
        self.killed: set[str] = set()
        #: The worker the simulator sends its callbacks to and the simulator's URL (None: no callbacks); a kill
        #: of that worker points the simulator at the replacement, a pause at another live worker.
        self.callback_receiver: tuple[str, str] | None = None

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

    def unplanned_exits(self) -> list[str]:
        """``"<name> (exit status N, log PATH)"`` for each worker that exited without this plan killing it."""
        return [
            f"{w.name} (exit status {w.proc.returncode}, log {w.log_path})"
            for w in self.fleet.workers.values()
            if not w.alive() and w.name not in self.killed
        ]

    def _victim(self) -> Worker:
        live = [w for w in self.fleet.live() if w.name not in self.killed]
        if not live:
            raise SoakError(f"no worker is left to fault; exited on their own: {self.unplanned_exits()}")
        return self.rng.choice(live)

    async def worker_kill(self) -> None:
        victim = self._victim()
        self.killed.add(victim.name)
        victim.signal(signal.SIGKILL)
        replacement = self.fleet.start()
        self.injected["worker_kill"] += 1
        if self.callback_receiver is not None and self.callback_receiver[0] == victim.name:
            await self.fleet.wait_ready(replacement.name)
            await self._receive_callbacks(replacement)

    async def _receive_callbacks(self, worker: Worker) -> None:
        """Point the simulator's callbacks at ``worker`` (``POST /_sim/config``)."""
        assert self.callback_receiver is not None
        sim_url = self.callback_receiver[1]
        async with httpx.AsyncClient(timeout=10.0) as client:
            answer = await client.post(
                f"{sim_url}/_sim/config", json={"callback_url": f"{worker.url}{self.fleet.settings.callback_path}"}
            )
            answer.raise_for_status()
        self.callback_receiver = (worker.name, sim_url)

    async def worker_pause(self) -> None:
        victim = self._victim()
        victim.signal(signal.SIGSTOP)
        self.injected["worker_pause"] += 1
        if self.callback_receiver is not None and self.callback_receiver[0] == victim.name:
            others = [w for w in self.fleet.live() if w.name not in self.killed and w is not victim]
            if others:  # the callbacks meanwhile sent to the stopped worker are unanswered, then lost
                await self._receive_callbacks(others[0])
        await asyncio.sleep(2 * self.opts.lease_ttl_ms / 1000.0 + 1.0)
        victim.signal(signal.SIGCONT)

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

    async def _toxic(self, toxic: dict[str, Any], seconds: float) -> None:
        async with self.toxiproxy.toxic(self.proxy, toxic):
            await asyncio.sleep(seconds)

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


async def run_soak(opts: SoakOptions, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run the soak and return its report (printed as a table and written as JSON). The run is isolated on the
    shared services like the main job's (:func:`streams_harness.run.isolated_run`); the workers reach the
    simulator through a Toxiproxy proxy of the run's own.

    Raises:
        RunStoppedError: an error stopped the soak, in the step it names; its cause is the error: SoakError (the
            simulator exited, or the fault plan failed), a service's error.
    """
    checkout_dir()  # outside a clone, fail before anything is created
    steps = RunSteps()
    try:
        return await _soak(opts, out, steps)
    except Exception as exc:
        raise steps.stopped(exc) from exc


async def _soak(opts: SoakOptions, out: TextIO, steps: RunSteps) -> dict[str, Any]:
    run_id = f"soak{int(time.time())}"
    sim_port = free_port()
    rows = read_trace(opts.trace, start=opts.start, rows=opts.rows)
    log_dir = run_dir(run_id)
    log_dir.mkdir(parents=True, exist_ok=True)
    toxiproxy = Toxiproxy()
    steps.enter("set-up: start Toxiproxy")
    await asyncio.to_thread(toxiproxy.ensure_running)
    async with isolated_run(Settings.from_env(), run_id, keep=opts.keep, out=out, steps=steps) as run_settings:
        steps.enter("start: the simulator and the workers")
        proxy = f"sim-{run_id}"
        proxy_port = await toxiproxy.create(proxy, f"127.0.0.1:{sim_port}")
        secret = callback_secret() if opts.callbacks else None
        settings = worker_settings(
            run_settings,
            lookup=opts.lookup,
            max_observation_age_s=opts.max_observation_age_s,
            callback_secret=secret,
        ).replace(
            remote_base_url=f"http://127.0.0.1:{proxy_port}",
            provider_dialect=opts.dialect,
            lease_ttl_ms=opts.lease_ttl_ms,
            remote_call_deadline_s=0.5 * opts.lease_ttl_ms / 1000.0,
            lease_margin_s=0.25 * opts.lease_ttl_ms / 1000.0,
            visibility_timeout_s=max(5.0, 2 * opts.lease_ttl_ms / 1000.0),
            kafka_session_timeout_s=10.0,
            kafka_heartbeat_interval_s=2.0,
            submitting_stale_after_s=opts.submitting_stale_after_s,
            submit_retry_deadline_s=opts.submit_retry_deadline_s,
            web_enabled=True,
        )
        fleet = Fleet(settings, log_dir)
        for _ in range(opts.workers):
            fleet.start()
        # the callbacks go to the first worker, and to its replacement when the plan kills it (Chaos.worker_kill)
        callback_url = f"{fleet.workers['w1'].url}{settings.callback_path}" if secret else ""
        sim_env = simulator_env(
            opts, settings, opts.sim_faults, callback_url=callback_url, callback_secret=secret or ""
        )
        sim = start_simulator(sim_port, log_dir / "simulator.log", sim_env)
        chaos = Chaos(opts, fleet, toxiproxy, proxy, out)
        if secret:
            chaos.callback_receiver = ("w1", f"http://127.0.0.1:{sim_port}")
        try:
            pool = await create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=2)
        except BaseException:  # the processes started: never leave them running
            fleet.stop_all()
            sim.terminate()
            sim.wait()
            await toxiproxy.delete(proxy)
            raise
        print(
            f"soak {run_id}: {len(rows)} rows, {opts.workers} workers, {opts.faults} faults (seed {opts.seed}), "
            f"logs in {log_dir}",
            file=out,
        )
        try:
            if secret:
                await fleet.wait_ready()  # the callbacks' receiver listens before the first job ends
            replay_s = rows[-1].arrival_s / opts.compression if rows else 0.0
            chaos_task = asyncio.create_task(chaos.run(chaos.plan(replay_s)))

            def check() -> None:
                if sim.poll() is not None:
                    raise SoakError(f"the simulator exited; see {log_dir / 'simulator.log'}")
                if exits := chaos.unplanned_exits():
                    raise SoakError(f"a worker exited on its own: {', '.join(exits)}")
                if chaos_task.done() and not chaos_task.cancelled() and chaos_task.exception() is not None:
                    raise SoakError(f"the fault plan failed: {chaos_task.exception()!r}")

            steps.enter("replay: submit the trace under the fault plan and wait until every operation is final")
            cancels = run_cancellations(rows, opts, run_id)
            try:
                ids, elapsed_s = await replay_until_final(
                    settings,
                    pool,
                    rows,
                    opts,
                    run_id,
                    out=out,
                    interval_s=5.0,
                    check=check,
                    busy=lambda: not chaos_task.done(),
                    extra=lambda: f"  faults {dict(chaos.injected)}",
                    cancels=cancels,
                )
            finally:
                chaos_task.cancel()
            meta = run_meta(
                opts,
                run_id,
                partitions=settings.partitions,
                rows=len(rows),
                faults=opts.sim_faults,
                elapsed_s=elapsed_s,
            )
            steps.enter("report: read the ledger, the simulator and the outputs topic")
            report = await collect_report(
                settings, pool, f"{run_id}-%", ids, meta, cancels=cancels, worker_urls=[w.url for w in fleet.live()]
            )
            report["faults_by_kind"] = dict(chaos.injected)
            report["faults_skipped"] = dict(chaos.skipped)
        finally:
            await pool.close()
            fleet.stop_all()
            sim.terminate()
            sim.wait()
            await toxiproxy.delete(proxy)
    write_report(report, opts.report_file(run_id), out)
    return report
