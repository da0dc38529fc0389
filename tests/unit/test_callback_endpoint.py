"""The worker serves the completion-callback endpoint (docs/callbacks.md) only with callbacks on."""

from __future__ import annotations

import base64

from aiohttp import web

from streams.config import Settings
from streams.worker.app import create_app


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
