"""Processes the harness runs: worker processes (``streams worker``) and the provider simulator, each a child
process with its own log file (the soak, the benchmark and the process-level tests; the main job runs the same two
through honcho and the Procfile), with what every run needs to start them: free loopback ports and the wait for a
health URL."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx
import tenacity
from prometheus_client.parser import text_string_to_metric_families

from streams.config import ENV_PREFIX, Settings
from streams.errors import StreamsError, error_summary
from streams_harness.checkout import checkout_dir

#: The ``streams`` script of the running virtualenv.
STREAMS = str(Path(sys.executable).with_name("streams"))

#: Seconds between two health probes of a starting process.
HEALTH_PROBE_INTERVAL_S = 0.2


class ProcessError(StreamsError):
    """A child process could not start, exited, or did not become ready; the message names its log file."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, below Linux's ephemeral range (see free_port_block)."""
    return free_port_block([0])


def free_port_block(offsets: list[int], low: int = 20000, high: int = 32000) -> int:
    """A base port whose ``base + offset`` ports are all free now, below Linux's ephemeral range (32768+), so
    outgoing connections' local ports cannot take them meanwhile.

    Raises:
        ProcessError: no such block found after 200 tries.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - max(offsets))
        try:
            for offset in offsets:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise ProcessError(f"no free block of ports {offsets} between {low} and {high}")


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file (or ``(no log)``)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _NotHealthy(Exception):
    """The probed URL answered, but not 200."""


async def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Wait until ``url`` answers 200 while ``proc`` runs: probed every :data:`HEALTH_PROBE_INTERVAL_S` (tenacity)
    while it refuses, fails or answers another status.

    Raises:
        ProcessError: ``proc`` exited (at the next probe), or ``url`` did not answer 200 within ``timeout_s`` (the
            message shows the end of ``log_path``, or names it).
    """
    async with httpx.AsyncClient(timeout=2.0) as client:

        async def probe() -> None:
            if proc.poll() is not None:
                raise ProcessError(f"process exited with {proc.returncode}; end of {log_path}:\n{tail(log_path)}")
            answer = await client.get(url)
            if answer.status_code != 200:
                raise _NotHealthy(f"HTTP {answer.status_code}")

        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type((httpx.HTTPError, _NotHealthy)),
            wait=tenacity.wait_fixed(HEALTH_PROBE_INTERVAL_S),
            stop=tenacity.stop_after_delay(timeout_s),
        )
        try:
            await retrying(probe)
        except tenacity.RetryError as exc:
            last = exc.last_attempt.exception()
            said = error_summary(last) if last is not None else "no answer"
            raise ProcessError(
                f"{url} did not answer 200 within {timeout_s:.0f} s (last: {said}); see {log_path}"
            ) from last


class Worker:
    """One worker process of a :class:`Fleet`: its name, process, web port (``/healthz``, ``/metrics``) and log."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], web_port: int, log_path: Path) -> None:
        self.name = name
        self.proc = proc
        self.web_port = web_port
        self.log_path = log_path

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    @property
    def url(self) -> str:
        """Base URL of the worker's web server (``http://127.0.0.1:<web_port>``)."""
        return f"http://127.0.0.1:{self.web_port}"

    def alive(self) -> bool:
        """True while the process has not exited (a stopped process is alive)."""
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process (ignored when it is gone)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def stopped(self) -> bool:
        """True while the process is stopped by SIGSTOP (state ``T`` in ``/proc/<pid>/stat``)."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    async def metric(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """The value of the sample ``name`` (e.g. ``streams_lease_busy_total``) with exactly ``labels`` in the
        worker's ``/metrics``, read with prometheus-client's parser; 0.0 when absent (a labelled counter appears
        at its first increment).

        Raises:
            httpx.HTTPError: the worker did not answer.
        """
        async with httpx.AsyncClient(timeout=5.0) as client:
            answer = await client.get(f"{self.url}/metrics")
        answer.raise_for_status()
        wanted = dict(labels or {})
        for family in text_string_to_metric_families(answer.text):
            for sample in family.samples:
                if sample.name == name and sample.labels == wanted:
                    return float(sample.value)
        return 0.0

    def log_text(self) -> str:
        """The whole log so far (invalid UTF-8 replaced)."""
        return self.log_path.read_text(errors="replace")


async def worker_counter_sums(worker_urls: Iterable[str], metric: str, label: str) -> dict[str, int]:
    """Samples of the counter ``metric`` (its ``_total`` sample name) summed over the workers at ``worker_urls``
    (``http://host:port``: their ``/metrics``) by the value of ``label`` (``unknown`` when a sample has none),
    sorted; a worker that does not answer is left out (its counts died with it)."""
    counts: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=5.0) as client:
        for url in worker_urls:
            try:
                answer = await client.get(f"{url}/metrics")
                answer.raise_for_status()
            except httpx.HTTPError:
                continue
            for family in text_string_to_metric_families(answer.text):
                for sample in family.samples:
                    if sample.name == metric and sample.value:
                        counts[sample.labels.get(label, "unknown")] += int(sample.value)
    return dict(sorted(counts.items()))


class Fleet:
    """Worker processes sharing one consumer group, each started with ``settings`` (plus its own overrides) as its
    environment and its own web port; logs in ``log_dir/worker-<name>.log``.

    ``command`` replaces ``streams worker`` (the benchmark runs its reference programs this way; they serve no
    ``/healthz``).
    """

    def __init__(self, settings: Settings, log_dir: Path, command: list[str] | None = None) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.command = command or [STREAMS, "worker"]
        self.workers: dict[str, Worker] = {}

    def start(
        self,
        name: str | None = None,
        *,
        faults: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> Worker:
        """Start one more worker named ``name`` (default ``w1``, ``w2``, ...) with the fleet's settings replaced by
        ``overrides`` (:meth:`Settings.replace`). Inherited ``STREAMS_*`` variables are dropped: the worker's
        settings are exactly these, and its log format the default (JSON lines).

        ``faults`` (``HARNESS_*`` variable -> value, see :mod:`streams_harness.faults`) runs ``streams worker``
        through ``python -m streams_harness.faults`` with those fault hooks armed, instead of the fleet's command.
        ``env``: more variables of the process's environment, not settings (e.g. libfaketime's ``LD_PRELOAD`` and
        ``FAKETIME``, :func:`faketime_env`).

        Raises:
            ProcessError: ``name`` is taken by another worker of this fleet.
        """
        name = name or f"w{len(self.workers) + 1}"
        if name in self.workers:
            raise ProcessError(f"a worker named {name!r} was already started in this fleet; give another name")
        settings = self.settings.replace(**overrides) if overrides else self.settings
        port = free_port()
        environment = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        environment.update(settings.replace(web_port=port, web_enabled=True).to_env())
        environment.update(faults or {})
        environment.update(env or {})
        command = [sys.executable, "-m", "streams_harness.faults", "worker"] if faults else self.command
        log_path = self.log_dir / f"worker-{name}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT, cwd=checkout_dir())
        self.workers[name] = Worker(name, proc, port, log_path)
        return self.workers[name]

    async def wait_ready(self, *names: str, timeout_s: float = 120.0) -> None:
        """Wait until the workers ``names`` (default: every one started) answer ``/healthz``.

        Raises:
            ProcessError: a worker exited or stayed silent for ``timeout_s`` (the message names its log).
        """
        for name in names or tuple(self.workers):
            worker = self.workers[name]
            await wait_healthy(f"{worker.url}/healthz", timeout_s, worker.proc, worker.log_path)

    def live(self) -> list[Worker]:
        """The workers still running, in the order they were started."""
        return [w for w in self.workers.values() if w.alive()]

    def stop_all(self, timeout_s: float = 20.0) -> None:
        """SIGCONT and SIGTERM every worker; SIGKILL those still running after ``timeout_s``."""
        for worker in self.workers.values():
            worker.signal(signal.SIGCONT)
            worker.signal(signal.SIGTERM)
        for worker in self.workers.values():
            try:
                worker.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()


#: libfaketime's library as Debian's ``faketime`` package installs it (``scripts/prod-services`` does).
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def faketime_env(shift: str, library: Path = LIBFAKETIME) -> dict[str, str]:
    """The environment that runs a process with its wall clock shifted by ``shift`` (libfaketime's relative form,
    e.g. ``+120s``, ``-120s``), its monotonic clock left alone (asyncio's timers, leases and deadlines run on it).

    Raises:
        ProcessError: ``library`` is missing (``apt-get install -y faketime``).
    """
    if not library.exists():
        raise ProcessError(f"{library} is missing: install Debian's faketime (apt-get install -y faketime)")
    return {"LD_PRELOAD": str(library), "FAKETIME": shift, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def start_simulator(port: int, log_path: Path, sim_env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``streams simulator`` on ``port`` with ``SIM_*`` variables ``sim_env``; output to ``log_path``."""
    env = dict(os.environ)
    env.update(sim_env)
    return subprocess.Popen(
        [STREAMS, "simulator", "--port", str(port)],
        env=env,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )
