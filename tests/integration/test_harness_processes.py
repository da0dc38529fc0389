"""The harness's waits for the processes it starts, against real processes and real sockets: a health URL
probed until it answers 200, a private redis-server until it answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiohttp import web

from streams_harness.fleet import ProcessError, free_port, wait_healthy
from streams_harness.redis_server import PrivateRedis

pytestmark = pytest.mark.integration


Child = tuple[subprocess.Popen[bytes], Path]


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Callable[[str], Child]]:
    """Starts ``python -c CODE`` as a child process; returns it and its log file (killed at the end)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(code: str) -> Child:
        log_path = tmp_path / "child.log"
        log_path.write_text("line 1\nError: the port is taken\n")
        started.append(subprocess.Popen([sys.executable, "-c", code]))
        return started[-1], log_path

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


SLEEPS = "import time; time.sleep(60)"


@pytest.fixture
async def health_server() -> AsyncIterator[tuple[str, list[int]]]:
    """``/healthz`` answering 503 twice, then 200; yields its URL and the statuses it answered."""
    answered: list[int] = []

    async def healthz(request: web.Request) -> web.Response:
        status = 503 if len(answered) < 2 else 200
        answered.append(status)
        return web.Response(status=status)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}/healthz", answered
    await runner.cleanup()


async def test_wait_healthy_probes_until_200(
    health_server: tuple[str, list[int]], child: Callable[[str], Child]
) -> None:
    url, answered = health_server
    await wait_healthy(url, 10.0, *child(SLEEPS))
    assert answered == [503, 503, 200]


async def test_wait_healthy_gives_up_at_the_deadline_naming_the_log(child: Callable[[str], Child]) -> None:
    proc, log_path = child(SLEEPS)
    url = f"http://127.0.0.1:{free_port()}/healthz"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ProcessError, match=r"did not answer 200 within 1 s \(last: ConnectError") as e:
        await wait_healthy(url, 1.0, proc, log_path)
    assert 1.0 <= time.monotonic() - started < 5.0
    assert str(log_path) in str(e.value)


async def test_wait_healthy_fails_at_once_when_the_process_exits(child: Callable[[str], Child]) -> None:
    proc, log_path = child("import sys; sys.exit(3)")
    url = f"http://127.0.0.1:{free_port()}/healthz"
    started = time.monotonic()
    with pytest.raises(ProcessError, match=r"process exited with 3; end of .*child.log:\nline 1\nError: the port"):
        await wait_healthy(url, 30.0, proc, log_path)
    assert time.monotonic() - started < 5.0  # not the 30 s deadline


async def test_a_private_redis_server_answers_once_started(tmp_path: Path) -> None:
    server = PrivateRedis(tmp_path)
    await server.start()
    try:
        client = aioredis.Redis.from_url(server.url)
        try:
            assert await client.ping()
            assert (await client.info("server"))["tcp_port"] == server.port  # its own server, not the shared one
        finally:
            await client.aclose()
    finally:
        server.stop()


async def test_a_private_redis_server_that_exits_fails_at_once(tmp_path: Path) -> None:
    with socket.socket() as taken:  # its port is taken: redis-server cannot listen and exits at once
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = PrivateRedis(tmp_path, port=taken.getsockname()[1])
        started = time.monotonic()
        with pytest.raises(ProcessError, match=r"port \d+ did not answer: .*exited while we waited") as e:
            await server.start()
        assert time.monotonic() - started < 5.0  # not at the end of the wait
        assert str(server.log_path) in str(e.value)
        assert "Address already in use" in server.log_path.read_text()  # the log it names says why
    server.stop()
