"""Who may read the worker's web server (streams.oncall.webaccess), what an operation's page leaves out
(streams.oncall.liveview.shown_detail), and which partitions count as blocked (streams.worker.inflight)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from streams.config import Settings
from streams.oncall import webaccess
from streams.oncall.liveview import shown_detail
from streams.worker.inflight import InOrderAcks

TOKEN = "t0ken-value"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize(
    ("header", "host"),
    [("127.0.0.1:6066", "127.0.0.1"), ("LocalHost", "localhost"), ("[::1]:6066", "::1"), ("::1", "::1"), (None, "")],
)
def test_host_name(header: str | None, host: str) -> None:
    assert webaccess.host_name(header) == host


def test_credentials_accept_only_the_configured_ones() -> None:
    both = webaccess.Credentials(Settings(web_auth_token=TOKEN, web_auth_user="u", web_auth_password="p"))
    assert both.accepts(f"Bearer {TOKEN}") and both.accepts(f"bearer  {TOKEN} ") and both.accepts(basic("u", "p"))
    for wrong in (
        None,
        "",
        "Bearer",
        f"Bearer {TOKEN}x",
        f"Token {TOKEN}",
        basic("u", "x"),
        basic("x", "p"),
        "Basic !!!",
        "Basic " + base64.b64encode(b"up").decode(),
    ):
        assert not both.accepts(wrong), wrong
    assert both.challenge == 'Bearer realm="streams", Basic realm="streams", charset="UTF-8"'
    none = webaccess.Credentials(Settings())
    assert not none.configured
    assert not none.accepts("Bearer ") and not none.accepts(basic("", ""))  # empty secrets open nothing
    token_only = webaccess.Credentials(Settings(web_auth_token=TOKEN, web_auth_user="u"))  # no password
    assert not token_only.accepts(basic("u", ""))


@pytest.fixture
async def client_for() -> AsyncIterator[object]:
    clients: list[TestClient[web.Request, web.Application]] = []

    async def make(settings: Settings) -> TestClient[web.Request, web.Application]:
        app = web.Application()
        webaccess.install(app, settings)

        async def page(request: web.Request) -> web.Response:
            return web.Response(text="page")

        for path in ("/", "/livez", "/readyz", "/metrics", "/operations/x"):
            app.router.add_get(path, page)
        app.router.add_post("/callbacks/generation", page)
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.close()


async def test_pages_ask_credentials_probes_and_metrics_do_not(client_for) -> None:  # type: ignore[no-untyped-def]
    c = await client_for(Settings(web_auth_token=TOKEN))
    for path in ("/", "/operations/x", "/nothing-here"):
        r = await c.get(path)
        assert (r.status, await r.text()) == (401, "authentication required\n")
        assert r.headers["X-Frame-Options"] == "DENY" and r.headers["X-Content-Type-Options"] == "nosniff"
    r = await c.get("/", headers={"Authorization": f"Bearer {TOKEN}"})
    assert (r.status, await r.text()) == (200, "page")
    assert "default-src 'none'" in r.headers["Content-Security-Policy"]
    for path in ("/livez", "/readyz", "/metrics"):
        assert (await c.get(path)).status == 200
    assert (await c.get("/", headers={"Host": "evil.example", "Authorization": f"Bearer {TOKEN}"})).status == 421


async def test_probes_and_metrics_can_ask_credentials_too(client_for) -> None:  # type: ignore[no-untyped-def]
    c = await client_for(Settings(web_auth_token=TOKEN, web_auth_probes=True, web_auth_metrics=True))
    for path in ("/livez", "/readyz", "/metrics"):
        assert (await c.get(path)).status == 401
        assert (await c.get(path, headers={"Authorization": f"Bearer {TOKEN}"})).status == 200


async def test_no_credentials_configured_serves_no_page(client_for) -> None:  # type: ignore[no-untyped-def]
    c = await client_for(Settings())
    assert (await c.get("/", headers={"Authorization": "Bearer "})).status == 401
    assert (await c.get("/livez")).status == 200


async def test_the_callback_path_skips_credentials_only_with_callbacks_on(client_for) -> None:  # type: ignore[no-untyped-def]
    secret = "whsec_" + base64.b64encode(b"k").decode()
    on = await client_for(Settings(web_auth_token=TOKEN, callbacks_enabled=True, callback_secrets=secret))
    assert (await on.post("/callbacks/generation")).status == 200  # the receiver checks the signature itself
    assert (await on.get("/")).status == 401
    off = await client_for(Settings(web_auth_token=TOKEN))
    assert (await off.post("/callbacks/generation")).status == 401


async def test_any_host_when_allowed(client_for) -> None:  # type: ignore[no-untyped-def]
    c = await client_for(Settings(web_allowed_hosts="*"))
    assert (await c.get("/livez", headers={"Host": "10.0.0.7:6066"})).status == 200


def test_shown_detail_hides_payloads_and_never_shows_lease_tokens() -> None:
    detail: dict[str, Any] = {
        "operation": {
            "operation_id": "op",
            "request": {"prompt": "secret"},
            "source": {"a": 1},
            "last_observation": {"outputs": ["x"]},
            "state": "running",
        },
        "outputs": [{"output_id": "o1", "payload": {"text": "secret"}}],
        "leases": [{"action": "observe", "key": "k", "owner_token": "tok", "ttl_ms": 5}],
    }
    hidden = shown_detail(detail, show_payloads=False)
    assert hidden["operation"] == {
        "operation_id": "op",
        "request": None,
        "source": None,
        "last_observation": None,
        "state": "running",
    }
    assert hidden["outputs"] == [{"output_id": "o1", "payload": None}]
    assert hidden["leases"] == [{"action": "observe", "key": "k", "ttl_ms": 5}]
    assert hidden["hidden"] == [
        "operation.request",
        "operation.source",
        "operation.last_observation",
        "outputs.payload",
    ]
    shown = shown_detail(detail, show_payloads=True)
    assert shown["operation"] == detail["operation"] and shown["outputs"] == detail["outputs"]
    assert shown["leases"] == hidden["leases"] and shown["hidden"] == []
    assert detail["leases"][0]["owner_token"] == "tok"  # the input is not changed


def test_blocked_partitions_are_those_with_finished_events_behind_an_unfinished_one() -> None:
    acks: InOrderAcks[int] = InOrderAcks()
    a = [acks.track("a", i) for i in range(3)]
    b = [acks.track("b", i) for i in range(2)]
    acks.track("c", 0)
    assert acks.blocked_partitions() == 0  # nothing finished yet: in flight, not blocked
    acks.finish(a[2])
    acks.finish(b[0])  # released at once: b is not blocked
    assert acks.blocked_partitions() == 1
    acks.finish(a[0])
    acks.finish(a[1])
    assert acks.blocked_partitions() == 0
