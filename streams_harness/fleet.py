"""Processes the soak and the benchmark run: worker processes (``streams worker``) and the provider simulator,
each a child process with its own log file. (The main job runs the same two through honcho and the Procfile.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from streams.config import Settings
from streams.errors import StreamsError
from streams_harness.checkout import checkout_dir
from streams_harness.mainjob import free_port

#: The ``streams`` script of the running virtualenv.
STREAMS = str(Path(sys.executable).with_name("streams"))


class ProcessError(StreamsError):
    """A child process exited or did not become ready; the message names its log file."""


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file (or ``(no log)``)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


async def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Wait until ``url`` answers 200 while ``proc`` runs.

    Raises:
        ProcessError: ``proc`` exited, or ``url`` did not answer within ``timeout_s`` (the message shows the log).
    """
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ProcessError(f"process exited with {proc.returncode}; end of {log_path}:\n{tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.2)
    raise ProcessError(f"{url} did not answer within {timeout_s:.0f} s; see {log_path}")


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
