"""Process-level test harness: real worker processes, the simulator on a real socket, Toxiproxy, services.

Everything here drives real processes and real services; assertions read independent records (the
simulator's, the ledger's, Kafka's).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from aiohttp import web

from streams.config import Settings
from streams_harness.fleet import free_port, free_port_block
from streams_harness.replay import trace_request
from streams_harness.simulator import SimulatorConfig, make_app
from streams_harness.trace import TraceRow

ROOT = Path(__file__).resolve().parents[1]
STREAMS = str(Path(sys.executable).with_name("streams"))


def provider_request(context_tokens: int, max_tokens: int, model: str | None = None) -> dict[str, Any]:
    """A request the provider simulator takes: a prompt of ``context_tokens`` tokens, ``max_tokens`` to generate."""
    request = trace_request(TraceRow(0, 0.0, context_tokens, max_tokens), model or "sim-1")
    if model is None:
        del request["model"]  # the worker's STREAMS_REMOTE_MODEL then applies
    return request


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms until true; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


class SimulatorServer:
    """The provider simulator served from the test's event loop on a loopback port."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, config: SimulatorConfig, port: int | None = None) -> None:
        """Bind on ``port`` (default: the config's; 0 = any free port)."""
        self.runner = web.AppRunner(make_app(config), shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", config.port if port is None else port).start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def get(self, path: str) -> Any:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as c:
            return (await c.get(path)).json()

    async def configure(self, **changes: Any) -> Any:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as c:
            r = await c.post("/_sim/config", json=changes)
            r.raise_for_status()
            return r.json()


@dataclass
class Worker:
    """One ``streams worker`` process."""

    name: str
    proc: subprocess.Popen[bytes]
    web_port: int
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def stopped(self) -> bool:
        """True while the process is stopped by SIGSTOP (state T in /proc)."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    async def metric(self, name: str, labels: str = "") -> float:
        """Value of one Prometheus sample of this worker (0.0 when absent)."""
        async with httpx.AsyncClient(timeout=5) as c:
            text = (await c.get(f"http://127.0.0.1:{self.web_port}/metrics")).text
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0

    async def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"worker {self.name} exited with {self.proc.returncode}; see {self.log_path}")
        try:
            async with httpx.AsyncClient(timeout=2) as c:
                return (await c.get(f"http://127.0.0.1:{self.web_port}/healthz")).status_code == 200
        except httpx.HTTPError:
            return False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Fleet:
    """Worker processes sharing one consumer group, with per-test settings."""

    settings: Settings
    log_dir: Path
    workers: dict[str, Worker] = field(default_factory=dict)

    def start(self, name: str, *, faults: dict[str, str] | None = None, **overrides: Any) -> Worker:
        """Start one worker with ``settings`` (plus ``overrides``) in the environment.

        ``faults`` (``HARNESS_*`` variable -> value, see :mod:`streams_harness.faults`) runs the worker through
        ``python -m streams_harness.faults`` with those fault hooks armed; without it, the ``streams`` script.
        """
        settings = self.settings.replace(**overrides) if overrides else self.settings
        port = free_port()
        env = dict(os.environ)
        env.update(settings.replace(web_enabled=True, web_port=port).to_env())
        env.update(faults or {})
        command = [sys.executable, "-m", "streams_harness.faults"] if faults else [STREAMS]
        log_path = self.log_dir / f"worker-{name}.log"
        proc = subprocess.Popen(
            [*command, "--log-level", "INFO", "worker", "--web-port", str(port)],
            env=env,
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        worker = Worker(name, proc, port, log_path)
        self.workers[name] = worker
        return worker

    async def wait_ready(self, *names: str, timeout_s: float = 60) -> None:
        for name in names or tuple(self.workers):
            await wait_for(self.workers[name].ready, timeout_s, f"worker {name} ready")

    def stop_all(self) -> None:
        for w in self.workers.values():
            w.signal(signal.SIGCONT)
            w.signal(signal.SIGTERM)
        for w in self.workers.values():
            try:
                w.proc.wait(20)
            except subprocess.TimeoutExpired:
                w.signal(signal.SIGKILL)
                w.proc.wait()


def unique_settings(base: Settings, **overrides: Any) -> Settings:
    """Settings with a fresh topic prefix, consumer group and lease key prefix."""
    run = uuid.uuid4().hex[:8]
    return base.replace(topic_prefix=f"f{run}.", app_id=f"streams-f{run}", lease_key_prefix=f"f{run}", **overrides)


class PrivateRedis:
    """A ``redis-server`` of the test's own on a free loopback port (its counters and script cache are the test's
    alone); ``persistent`` = AOF with fsync always."""

    def __init__(self, data_dir: Path, persistent: bool) -> None:
        self.data_dir = data_dir
        self.persistent = persistent
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir), "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        log = (self.data_dir / "redis.log").open("ab")
        self.proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", *args], stdout=log, stderr=log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP the server: it keeps its connections open but answers nothing until :meth:`resume`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the server."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    async def wait_ready(self) -> None:
        probe = aioredis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    if await probe.ping():
                        return
                except (OSError, ConnectionError, aioredis.ConnectionError):
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"private redis-server on {self.port} did not come up")
                await asyncio.sleep(0.05)
        finally:
            await probe.aclose()

    async def restart(self) -> None:
        self.stop()
        self.start()
        await self.wait_ready()


def services(*args: str) -> None:
    """Run ``scripts/services <args>`` (stop/start/restart of a service this project manages)."""
    subprocess.run([str(ROOT / "scripts" / "services"), *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


class ThrowawayBroker:
    """A second, brand-new single-node Kafka, started and stopped by ``scripts/services`` on free ports with its
    data in ``data_dir``; the shared broker is not touched. The jars are the repository's (``.data/kafka/libs``,
    fetched by ``scripts/services`` if missing)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port_block([0, 1])
        self.env = dict(os.environ)
        self.env.update(
            {
                "SERVICES_DATA_DIR": str(data_dir),
                "SERVICES_KAFKA_PORT": str(self.port),
                "SERVICES_KAFKA_CONTROLLER_PORT": str(self.port + 1),
                "SERVICES_KAFKA_LIBS": str(ROOT / ".data" / "kafka" / "libs"),
                "KAFKA_HEAP_OPTS": "-Xms128m -Xmx384m",
            }
        )

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "kafka" / "kafka.log"

    def services(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        """Run ``scripts/services <args>`` for this broker; returns the finished process (output captured)."""
        return subprocess.run(
            [str(ROOT / "scripts" / "services"), *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def start(self, *options: str) -> None:
        """``scripts/services start kafka [options]``; fails the test with the script's output if it fails."""
        done = self.services("start", "kafka", *options)
        if done.returncode != 0:
            raise AssertionError(f"scripts/services start kafka failed:\n{done.stdout}\n{done.stderr}")

    def stop(self) -> None:
        self.services("stop", "kafka")


async def kafka_tool(main_class: str, *args: str, stdin: bytes = b"", timeout_s: float = 180) -> str:
    """Run one of Kafka's own command-line tools (``scripts/services kafka-tool``: the broker's jars, fetched
    when missing) without blocking the event loop; returns its standard output.

    Raises:
        AssertionError: the tool exited non-zero (its stderr in the message) or ran past ``timeout_s``.
    """
    proc = await asyncio.create_subprocess_exec(
        str(ROOT / "scripts" / "services"),
        "kafka-tool",
        main_class,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"{main_class} ran past {timeout_s} s") from None
    assert proc.returncode == 0, f"{main_class} exited {proc.returncode}: {err.decode(errors='replace')[-2000:]}"
    return out.decode()
