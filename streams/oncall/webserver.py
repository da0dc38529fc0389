"""The bounds of the worker's web server: at most ``web_max_connections`` connections at once, each given
``web_header_timeout_s`` to send a request's headers (and closed after as long idle between requests).

Beyond the cap a new connection is answered at once with ``503`` and ``Connection: close`` (without reading its
request), counted in ``streams_web_connections_refused_total`` and logged once per burst: a WARNING at the first
refusal, an INFO with the burst's count when a connection is accepted again. A refused connection's request is
read and discarded for at most :data:`REFUSAL_LINGER_S` after the answer, so the client reads the 503 instead of a
reset. The header deadline is aiohttp's ``keepalive_timeout``, armed when a connection opens: a connection that
has not sent a complete request line and headers by then is closed (``aiohttp/web_protocol.py``
``connection_made``, ``_process_keepalive``). Request bodies have their own deadlines (the callbacks':
``callback_body_timeout_s``). docs/operations-http-and-alerts.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from aiohttp import web

from streams import metrics

log = logging.getLogger(__name__)

#: Seconds a refused connection is kept open after its 503, reading and discarding, so the client reads the
#: answer (closing a socket with unread data sends a reset, which may destroy the answer before it is read).
REFUSAL_LINGER_S = 1.0

_REFUSAL_BODY = b"busy: too many connections, retry shortly\n"

#: The answer to a connection beyond the cap.
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\n"
    b"Retry-After: 1\r\n"
    b"Cache-Control: no-store\r\n"
    b"Connection: close\r\n"
    b"\r\n" % len(_REFUSAL_BODY)
) + _REFUSAL_BODY


class _Refusal(asyncio.Protocol):
    """One connection beyond the cap: :data:`REFUSAL`, then its input discarded until it closes or
    :data:`REFUSAL_LINGER_S` passed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.closing: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)
        stream.write(REFUSAL)
        if stream.can_write_eof():
            stream.write_eof()
        self.closing = self.loop.call_later(REFUSAL_LINGER_S, stream.close)

    def data_received(self, data: bytes) -> None:
        """Discard the request."""

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closing is not None:
            self.closing.cancel()


class CappedServer(web.Server):
    """aiohttp's low-level server, refusing connections beyond ``max_connections`` (see the module)."""

    def __init__(self, server: web.Server, max_connections: int) -> None:
        # The same handler, request factory and handler options as ``server`` (made by the Application).
        super().__init__(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            **server._kwargs,
        )
        self.max_connections = max_connections
        #: Connections refused since the burst began (0: not refusing).
        self.refused_in_burst = 0

    def __call__(self) -> Any:  # asyncio's protocol factory; aiohttp types it as returning a RequestHandler
        if len(self._connections) >= self.max_connections:
            metrics.WEB_CONNECTIONS_REFUSED.inc()
            if not self.refused_in_burst:
                log.warning(
                    "the web server holds web_max_connections (%d) connections: refusing new ones with 503 "
                    "(counted in streams_web_connections_refused_total)",
                    self.max_connections,
                )
            self.refused_in_burst += 1
            return _Refusal(self._loop)
        if self.refused_in_burst:
            log.info("the web server accepts connections again, after refusing %d", self.refused_in_burst)
            self.refused_in_burst = 0
        return super().__call__()


class CappedRunner(web.AppRunner):
    """aiohttp's application runner with the bounds of the module: a :class:`CappedServer` whose connections
    have ``header_timeout_s`` to send each request's headers."""

    def __init__(self, app: web.Application, max_connections: int, header_timeout_s: float) -> None:
        super().__init__(app, access_log=None, keepalive_timeout=header_timeout_s)
        self.max_connections = max_connections

    async def _make_server(self) -> web.Server:
        return CappedServer(await super()._make_server(), self.max_connections)
