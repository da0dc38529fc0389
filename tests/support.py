"""Process-level test support: the simulator on a real socket, a throwaway broker, Kafka's tools, services (worker
processes and private redis-servers: :mod:`streams_harness.fleet`, :mod:`streams_harness.redis_server`).

Everything here drives real processes and real services; assertions read independent records (the
simulator's, the ledger's, Kafka's).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from aiohttp import web

from streams.config import Settings
from streams.ledger.store import Ledger
from streams.worker.runtime import Runtime
from streams_harness.fleet import free_port_block
from streams_harness.replay import trace_request
from streams_harness.simulator import SimulatorConfig, make_app
from streams_harness.trace import TraceRow

ROOT = Path(__file__).resolve().parents[1]

#: Settings overrides giving each remote call room on a loaded machine, for fleet tests whose point is not a call
#: cut off: the suite's 1.4 s whole-call deadline (tests/conftest.py) would cut off a POST the provider served (its
#: job created) and leave the operation uncertain, which is right of the product and beside such a test's point.
#: The lease around a call outlives it by the margin (remote_call_deadline_s + lease_margin_s < lease TTL), and a
#: poll's visibility timeout is at least the lease TTL.
ROOM_FOR_CALLS: dict[str, Any] = {
    "http_read_timeout_s": 5.0,
    "remote_call_deadline_s": 6.0,
    "lease_margin_s": 1.0,
    "lease_ttl_ms": 8000,
    "visibility_timeout_s": 8.0,
}


def provider_request(context_tokens: int, max_tokens: int, model: str | None = None) -> dict[str, Any]:
    """A request the provider simulator takes: a prompt of ``context_tokens`` tokens, ``max_tokens`` to generate."""
    request = trace_request(TraceRow(0, 0.0, context_tokens, max_tokens), model or "sim-1")
    if model is None:
        del request["model"]  # the worker's STREAMS_REMOTE_MODEL then applies
    return request


async def stop_tasks(tasks: list[asyncio.Task[Any]], timeout_s: float = 30.0) -> None:
    """Cancel ``tasks`` and wait for them to end; fail naming those still running after ``timeout_s`` (a task
    that swallowed its cancel), where an unbounded gather hung until pytest's timeout with no word."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in done:  # retrieved, as gather(return_exceptions=True) did: no "never retrieved" warning
        if not task.cancelled():
            task.exception()
    if pending:
        raise AssertionError(f"still running {timeout_s} s after their cancel: {[t.get_coro() for t in pending]}")


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms until true; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


async def key_exists(client: aioredis.Redis, key: str | bytes) -> bool:
    """Whether ``key`` is set in Redis (a :func:`wait_for` predicate)."""
    return await client.exists(key) == 1


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


def unique_settings(base: Settings, **overrides: Any) -> Settings:
    """Settings with a fresh topic prefix, consumer group and lease key prefix."""
    run = uuid.uuid4().hex[:8]
    return base.replace(topic_prefix=f"f{run}.", app_id=f"streams-f{run}", lease_key_prefix=f"f{run}", **overrides)


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


class ReplyCutter:
    """A TCP relay to a service on loopback ``upstream_port`` that, once armed with ``marker``, lets the first
    request carrying it reach the service, throws its replies away once they come back (so the request did run)
    and closes that client connection: a network cut between the service running a request and the client
    reading its replies. Every other connection and request is relayed as is."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.marker: bytes | None = None
        self.cut = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        cutting = asyncio.Event()

        async def upward() -> None:
            while data := await reader.read(65536):
                if self.marker is not None and self.marker in data:
                    self.marker = None
                    cutting.set()
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def downward() -> None:
            while data := await up_reader.read(65536):
                if cutting.is_set():  # Redis ran the request: its replies never reach the client
                    self.cut += 1
                    writer.transport.abort()
                    up_writer.close()
                    return
                writer.write(data)
                await writer.drain()
            writer.close()

        for coro in (upward(), downward()):
            task = asyncio.ensure_future(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


#: Every table a test session empties before each test (the ledger's rows; the reference tables stay): the tables
#: without a foreign key to ``operations`` must be named, as TRUNCATE ... CASCADE does not reach them.
LEDGER_TABLES = (
    "callback_deliveries, cancellations, dead_letter_redrives, erasures, refunds, remote_jobs, remote_calls, outbox, "
    "outputs, transitions, operations"
)


def real_ledger(rt: Runtime) -> Ledger:
    """The PostgreSQL ledger of a runtime the integration tier built (its operators' and accounting calls are not
    part of :class:`streams.ledger.protocol.PipelineLedger`)."""
    assert isinstance(rt.ledger, Ledger), type(rt.ledger)
    return rt.ledger
