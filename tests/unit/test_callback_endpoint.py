"""The worker serves the completion-callback endpoint (docs/callbacks.md) only with callbacks on."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY

from streams.config import Settings
from streams.ledger.records import CallbackNote
from streams.remote import callbacks
from streams.worker.app import create_app
from streams.worker.stages.callbacks import CallbackReceiver
from streams.worker.wakeup import Wakeups


def _web_app(settings: Settings) -> web.Application:
    """The aiohttp application under the worker's Faust web server."""
    web_app: web.Application = create_app(settings).web.web_app  # type: ignore[attr-defined]  # the aiohttp driver's
    return web_app


def callback_routes(settings: Settings) -> list[tuple[str, str]]:
    routes = _web_app(settings).router.routes()
    return [(r.method, r.resource.canonical) for r in routes if r.resource and "callback" in r.resource.canonical]


def test_the_callback_endpoint_is_served_only_with_callbacks_on() -> None:
    secret = "whsec_" + base64.b64encode(b"k").decode()
    on = Settings(callbacks_enabled=True, callback_secrets=secret, callback_path="/hooks/done")
    assert callback_routes(on) == []  # the path is the setting's
    assert [(m, p) for m, p in _all_routes(on) if p == "/hooks/done"] == [("POST", "/hooks/done")]
    assert callback_routes(Settings(callbacks_enabled=True, callback_secrets=secret)) == [
        ("POST", "/callbacks/generation")
    ]
    assert callback_routes(Settings()) == []


def _all_routes(settings: Settings) -> list[tuple[str, str]]:
    return [(r.method, r.resource.canonical) for r in _web_app(settings).router.routes() if r.resource]


class _NoLedger:
    """A ledger the refusals below never reach."""

    async def note_callback(self, webhook_id: str, remote_job_id: str) -> None:
        raise AssertionError("a refused callback reached the ledger")


@asynccontextmanager
async def _receiver(settings: Settings) -> AsyncIterator[int]:
    """A web server serving only the callback endpoint with ``settings``; yields its port."""
    runtime = SimpleNamespace(settings=settings, ledger=_NoLedger(), wakeups=Wakeups())
    web_app = web.Application()
    web_app.router.add_post("/cb", CallbackReceiver(runtime).handle)  # type: ignore[arg-type]  # the parts it uses
    runner = web.AppRunner(web_app, lingering_time=0)  # the unread rest of a refused body is not waited for
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def _status_line(port: int, request: bytes) -> bytes:
    """The status line answered to ``request`` sent raw (the connection kept open, nothing more sent)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(30):  # a bound on the wait for the condition, not the behaviour tested
            return (await reader.readline()).strip()
    finally:
        writer.close()


_SECRET = "whsec_" + base64.b64encode(b"callback endpoint unit test").decode()


async def test_a_body_trickling_slower_than_its_deadline_is_refused_408() -> None:
    settings = Settings(callbacks_enabled=True, callback_secrets=_SECRET, callback_body_timeout_s=0.2)
    before = REGISTRY.get_sample_value("streams_callbacks_refused_total", {"reason": "body_timeout"}) or 0.0
    async with _receiver(settings) as port:
        # 1 byte of the 100 announced, then nothing: the handler waited for the rest for ever.
        line = await _status_line(port, b"POST /cb HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert line == b"HTTP/1.1 408 Request Timeout"
    assert REGISTRY.get_sample_value("streams_callbacks_refused_total", {"reason": "body_timeout"}) == before + 1


async def test_a_chunked_body_over_the_limit_without_content_length_is_refused_413() -> None:
    settings = Settings(callbacks_enabled=True, callback_secrets=_SECRET, callback_max_body_bytes=1000)
    body = b"x" * 5000
    async with _receiver(settings) as port:
        line = await _status_line(
            port,
            b"POST /cb HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(body)
            + body
            + b"\r\n0\r\n\r\n",
        )
    assert line == b"HTTP/1.1 413 Request Entity Too Large"


class _LedgerWithoutTheJob:
    """A ledger in which no operation has the callback's job (note_callback's answer for an unknown job)."""

    async def note_callback(self, webhook_id: str, remote_job_id: str) -> CallbackNote:
        return CallbackNote(operation_id=None, recorded=False, made_due=False)


async def test_an_unknown_job_is_refused_404_with_the_webhook_id_and_job_id_in_its_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = Settings(callbacks_enabled=True, callback_secrets=_SECRET)
    runtime = SimpleNamespace(settings=settings, ledger=_LedgerWithoutTheJob(), wakeups=Wakeups())
    web_app = web.Application()
    web_app.router.add_post("/cb", CallbackReceiver(runtime).handle)  # type: ignore[arg-type]  # the parts it uses
    body = b'{"type": "generation.completed", "data": {"id": "job_0123456789abcdef"}}'
    now_s = int(time.time())
    key = base64.b64decode(_SECRET.removeprefix("whsec_"))
    headers = {
        "webhook-id": "msg_unknown_1",
        "webhook-timestamp": str(now_s),
        "webhook-signature": callbacks.signature(key, "msg_unknown_1", now_s, body),
    }
    async with TestClient(TestServer(web_app)) as client:
        with caplog.at_level(logging.WARNING, logger="streams.worker.stages.callbacks"):
            response = await client.post("/cb", data=body, headers=headers)
            assert response.status == 404
            assert await response.text() == "refused: unknown_job\n"
    lines = [r.getMessage() for r in caplog.records if r.name == "streams.worker.stages.callbacks"]
    assert lines == [
        "completion callback refused (unknown_job): delivery 'msg_unknown_1': no operation has job "
        "'job_0123456789abcdef' (yet); the sender retries"
    ]
