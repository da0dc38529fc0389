"""Who may read the worker's web server, and the headers every answer carries (aiohttp middleware).

Every request's ``Host`` (without its port) must be one of ``web_allowed_hosts`` (``*``: any), else 421. Then
every path but the probes (:data:`PROBE_PATHS`) and :data:`METRICS_PATH` asks for credentials: ``Authorization:
Bearer <web_auth_token>`` or ``Basic`` with ``web_auth_user``/``web_auth_password``, compared in constant time
(:func:`hmac.compare_digest`); ``web_auth_probes`` and ``web_auth_metrics`` ask them for those paths too. The
callback path (with ``callbacks_enabled``) never asks them: each callback carries its own signature
(docs/callbacks.md). With no credentials configured, nothing but the open paths is served. A refused request gets
401 with ``WWW-Authenticate`` and a fixed body, nothing else. Every answer carries :data:`SECURITY_HEADERS`.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from streams.config import Settings

#: The probes' paths (liveness, readiness, and the readiness alias kept for the harness).
PROBE_PATHS = frozenset({"/livez", "/readyz", "/healthz"})
METRICS_PATH = "/metrics"

#: Headers of every answer: no script, no framing, no content sniffing, no referrer, nothing cached.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def host_name(host_header: str | None) -> str:
    """The host name of a ``Host`` header, lower case, without its port (``[::1]:6066`` -> ``::1``)."""
    host = (host_header or "").strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host


class Credentials:
    """The configured credentials of ``settings``; :meth:`accepts` checks an ``Authorization`` header."""

    def __init__(self, settings: Settings) -> None:
        token = settings.web_auth_token.get_secret_value()
        self._token = token.encode() if token else None
        password = settings.web_auth_password.get_secret_value()
        self._basic = (
            (settings.web_auth_user.encode(), password.encode()) if settings.web_auth_user and password else None
        )

    @property
    def configured(self) -> bool:
        """True when a token or basic credentials are set."""
        return self._token is not None or self._basic is not None

    @property
    def challenge(self) -> str:
        """The ``WWW-Authenticate`` value of a refusal."""
        schemes = ['Bearer realm="streams"'] if self._token is not None or self._basic is None else []
        if self._basic is not None:
            schemes.append('Basic realm="streams", charset="UTF-8"')
        return ", ".join(schemes)

    def accepts(self, authorization: str | None) -> bool:
        """True when ``authorization`` (the header's value) carries the configured token or basic credentials."""
        scheme, _, value = (authorization or "").strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer" and self._token is not None:
            return hmac.compare_digest(value.encode(), self._token)
        if scheme.lower() == "basic" and self._basic is not None:
            try:
                decoded = base64.b64decode(value.encode(), validate=True)
            except (binascii.Error, ValueError):
                return False
            user, colon, password = decoded.partition(b":")
            user_ok = hmac.compare_digest(user, self._basic[0])
            password_ok = hmac.compare_digest(password, self._basic[1])
            return bool(colon) and user_ok and password_ok
        return False


def access_middleware(settings: Settings) -> Middleware:
    """The aiohttp middleware applying the host check and the credentials of ``settings`` (see the module)."""
    allowed = settings.web_allowed_host_names
    credentials = Credentials(settings)
    open_paths: set[str] = set()
    if not settings.web_auth_probes:
        open_paths |= PROBE_PATHS
    if not settings.web_auth_metrics:
        open_paths.add(METRICS_PATH)
    if settings.callbacks_enabled:  # authenticated by its signature (docs/callbacks.md), not by credentials
        open_paths.add(settings.callback_path)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if "*" not in allowed and host_name(request.headers.get("Host")) not in allowed:
            return web.Response(status=421, text="host not served here\n")
        if request.path not in open_paths and not credentials.accepts(request.headers.get("Authorization")):
            return web.Response(
                status=401, text="authentication required\n", headers={"WWW-Authenticate": credentials.challenge}
            )
        return await handler(request)

    return middleware


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp ``on_response_prepare`` hook: :data:`SECURITY_HEADERS` on every answer (errors included)."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


def install(web_app: web.Application, settings: Settings) -> None:
    """Put the access middleware and the security headers on ``web_app`` (before it starts)."""
    web_app.middlewares.append(access_middleware(settings))
    web_app.on_response_prepare.append(add_security_headers)
