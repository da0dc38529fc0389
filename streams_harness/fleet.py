"""Processes the harness runs: worker processes (``streams worker``) and the provider simulator, each a child
process with its own log file (the soak and the benchmark; the main job runs the same two through honcho and the
Procfile), with what every run needs to start them: free loopback ports and the wait for a health URL."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import tenacity

from streams.config import Settings
from streams.errors import StreamsError
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
            raise ProcessError(
                f"{url} did not answer 200 within {timeout_s:.0f} s (last: {type(last).__name__}: {last}); "
                f"see {log_path}"
            ) from last


class Fleet:
    """Worker processes sharing one consumer group, each started with ``settings`` in its environment and its
    own web port (``/healthz``, ``/metrics``); logs in ``log_dir/worker-<name>.log``.

    ``command`` replaces ``streams worker`` (the benchmark runs its reference programs this way; they serve no
    ``/healthz``).
    """

    def __init__(self, settings: Settings, log_dir: Path, command: list[str] | None = None) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.command = command or [STREAMS, "worker"]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.web_ports: dict[str, int] = {}
        self._n = 0

    def start(self) -> str:
        """Start one more worker; returns its name (``w1``, ``w2``, ...)."""
        self._n += 1
        name = f"w{self._n}"
        port = free_port()
        env = dict(os.environ)
        env.update(self.settings.replace(web_port=port, web_enabled=True).to_env())
        log = (self.log_dir / f"worker-{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            self.command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=checkout_dir()
        )
        self.web_ports[name] = port
        return name

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until every live worker answers ``/healthz``.

        Raises:
            ProcessError: a worker exited or stayed silent for ``timeout_s``.
        """
        for name in self.live():
            log_path = self.log_dir / f"worker-{name}.log"
            url = f"http://127.0.0.1:{self.web_ports[name]}/healthz"
            await wait_healthy(url, timeout_s, self.procs[name], log_path)

    def pid(self, name: str) -> int:
        """The process id of worker ``name``."""
        return self.procs[name].pid

    def live(self) -> list[str]:
        """Names of the workers still running."""
        return [n for n, p in self.procs.items() if p.poll() is None]

    def signal(self, name: str, sig: signal.Signals) -> None:
        """Send ``sig`` to worker ``name`` (ignored when it is gone)."""
        with contextlib.suppress(ProcessLookupError):
            self.procs[name].send_signal(sig)

    def stop_all(self, timeout_s: float = 20.0) -> None:
        """SIGCONT and SIGTERM every worker; SIGKILL those still running after ``timeout_s``."""
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


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
