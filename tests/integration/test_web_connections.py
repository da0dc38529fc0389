"""The worker's web server bounds its connections (streams.oncall.webserver): the worker app's own server (built by
``create_app``, started without Kafka), met with real sockets.

Slow senders fill ``web_max_connections``; one more connection is answered 503 at once and counted; the slow
ones are closed by the header deadline (``web_header_timeout_s``); then a normal request gets through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from streams import metrics
from streams.config import Settings
from streams.worker.app import create_app
from streams_harness.fleet import free_port
from tests.support import unique_settings, wait_for

pytestmark = pytest.mark.integration

MAX_CONNECTIONS = 3
HEADER_TIMEOUT_S = 1.0
#: A request whose headers never end: the slow sender's.
PARTIAL_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


@contextlib.asynccontextmanager
async def web_server(settings: Settings) -> AsyncIterator[int]:
    """The worker app's web server for ``settings`` on a free port (its port), stopped on exit."""
    port = free_port()
    web: Any = create_app(settings.replace(web_port=port)).web  # faust's aiohttp driver
    await web.start_server()
    try:
        yield port
    finally:
        await web.stop_server()


async def slow_sender(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(PARTIAL_REQUEST)
    await writer.drain()
    return reader, writer


async def test_a_connection_beyond_the_cap_is_refused_at_once_and_slow_senders_time_out(
    base_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    settings = unique_settings(
        base_settings, web_max_connections=MAX_CONNECTIONS, web_header_timeout_s=HEADER_TIMEOUT_S
    )
    refused_before = metrics.WEB_CONNECTIONS_REFUSED._value.get()
    caplog.set_level(logging.INFO, logger="streams.oncall.webserver")
    async with web_server(settings) as port:
        slow = [await slow_sender(port) for _ in range(MAX_CONNECTIONS)]
        loop = asyncio.get_running_loop()
        started = loop.time()

        # Two more: each is answered 503 at once (long before the header deadline), without sending a byte.
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            async with asyncio.timeout(HEADER_TIMEOUT_S / 2):
                answer = await reader.read()  # the server closes it after the answer
            writer.close()
            assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
            assert b"Connection: close\r\n" in answer
            assert answer.endswith(b"\r\n\r\nbusy: too many connections, retry shortly\n")
        assert loop.time() - started < HEADER_TIMEOUT_S
        assert metrics.WEB_CONNECTIONS_REFUSED._value.get() == refused_before + 2
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1  # once per burst
        assert "web_max_connections (3)" in warnings[0].getMessage()

        # The slow senders are closed by the header deadline, answered nothing.
        for reader, writer in slow:
            async with asyncio.timeout(HEADER_TIMEOUT_S * 10):
                assert await reader.read() == b""
            writer.close()
        assert loop.time() - started >= HEADER_TIMEOUT_S * 0.9

        # Room again: a normal request gets through (the end of the burst is logged with its count).
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:

            async def answered() -> bool:
                return (await c.get("/metrics")).status_code == 200

            await wait_for(answered, 10, "a normal request answered after the slow senders were closed")
            page = (await c.get("/metrics")).text
        assert f"streams_web_connections_refused_total {refused_before + 2:.1f}" in page
        assert any("after refusing 2" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


async def test_a_normal_request_is_served_while_under_the_cap(base_settings: Settings) -> None:
    settings = unique_settings(base_settings, web_max_connections=MAX_CONNECTIONS, web_header_timeout_s=5.0)
    async with web_server(settings) as port:
        slow = [await slow_sender(port) for _ in range(MAX_CONNECTIONS - 1)]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            r = await c.get("/metrics")
        assert r.status_code == 200
        assert "streams_web_connections_refused_total" in r.text
        for _, writer in slow:
            writer.close()
