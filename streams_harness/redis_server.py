"""A ``redis-server`` of the caller's own on a free loopback port: its counters (``INFO stats``, ``INFO
commandstats``) and script cache are the caller's alone, and it can be stopped, paused (SIGSTOP: connections stay
open, nothing answers) and restarted without touching the shared Redis. The benchmark counts its programs'
commands on one; tests break one on purpose."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

from streams.config import Settings
from streams.errors import ServiceNotReadyError
from streams.setup.readiness import wait_ready
from streams_harness.fleet import ProcessError, free_port

#: Seconds a started server has to answer SET/GET.
START_TIMEOUT_S = 10.0


class PrivateRedis:
    """A ``redis-server`` on ``127.0.0.1:port`` (default: a free port) with its data and its log
    (``redis.log``, appended to across restarts) in ``data_dir``; ``persistent``: AOF with fsync always (a restart
    keeps every write), else no persistence (a restart forgets everything)."""

    def __init__(self, data_dir: Path, *, persistent: bool = False, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.persistent = persistent
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        """True when a ``redis-server`` binary is on the PATH (``scripts/setup`` installs one)."""
        return shutil.which("redis-server") is not None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.data_dir / "redis.log"

    async def start(self) -> None:
        """Start the server and wait until it answers SET/GET (the product's readiness check,
        :func:`streams.setup.readiness.wait_ready`, within :data:`START_TIMEOUT_S`; it fails at once if the server
        exits).

        Raises:
            ProcessError: no ``redis-server`` binary, or the server exited (e.g. its port was taken) or did not
                answer in time; the message names its log.
        """
        self.proc = self._spawn()
        try:
            await wait_ready(Settings(redis_url=self.url), ["redis"], START_TIMEOUT_S, pids={"redis": self.proc.pid})
        except ServiceNotReadyError as exc:
            raise ProcessError(
                f"the private redis-server on port {self.port} did not answer: {exc}; see {self.log_path}"
            ) from exc

    def _spawn(self) -> subprocess.Popen[bytes]:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ProcessError("redis-server is not installed (scripts/setup installs it)")
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir), "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        with self.log_path.open("ab") as log:
            return subprocess.Popen([binary, *args], stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        """Stop the server (resumed first if paused); nothing happens when it is not running."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP the server: it keeps its connections open but answers nothing until :meth:`resume`."""
        assert self.proc is not None, "start the server first"
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the server."""
        assert self.proc is not None, "start the server first"
        self.proc.send_signal(signal.SIGCONT)

    async def restart(self) -> None:
        """Stop and start again on the same port (see :meth:`start`)."""
        self.stop()
        await self.start()
