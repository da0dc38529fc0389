"""An ``httpx`` transport backed by aiohttp: the httpx API for the remote client, aiohttp's cheaper HTTP/1.1
engine underneath (measured with ``streams bench``: README, "Benchmark").

The remote client's error taxonomy (:mod:`streams.remote`) decides from the httpx exception type whether a
request may have reached the API. This module maps every aiohttp failure to the httpx type that tells the truth:

========================================================= ============================== ==================
aiohttp raised                                            httpx raised here              request sent?
========================================================= ============================== ==================
``ConnectionTimeoutError`` (no free pooled connection or  ``ConnectTimeout``             no
TCP connect within the time)
``ClientConnectorError`` and subclasses (refused, DNS,    ``ConnectError``               no
TLS handshake)
``InvalidURL``, ``NonHttpUrlClientError`` (refused URL)   ``UnsupportedProtocol``        no
``SocketTimeoutError``, any other ``ServerTimeoutError``, ``ReadTimeout``                maybe
a bare ``TimeoutError``
``ServerDisconnectedError``                               ``RemoteProtocolError``        maybe
``ClientResponseError`` (a malformed answer)              ``RemoteProtocolError``        maybe
``ClientPayloadError`` (the body broke off)               ``ReadError``                  maybe
``ClientConnectionResetError``, ``UploadAbortedError``    ``WriteError``                 maybe
any other ``ClientError`` (``ClientOSError``, ...)        ``ReadError``                  maybe
========================================================= ============================== ==================

"Maybe" types are all outside :data:`streams.remote` ``_NOT_SENT``, so a POST that may have been sent is never
re-sent. httpx-aiohttp (PyPI) was not used for this reason: its table maps every ``ClientConnectionError``,
``ServerDisconnectedError`` included, to ``ConnectTimeout``, which would make a POST whose connection was lost
after sending look unsent, and the dispatcher would POST it again (a second remote job).

aiohttp itself never re-sends a POST: it retries a request once on a broken keep-alive connection only for
idempotent methods (``GET`` here, sequentially: still at most one GET in flight per job).

httpcore's ``trace`` request extension is honoured as far as the remote client needs it: the callback gets
``http11.send_request_headers.started`` as soon as aiohttp holds a connection for the request (new or reused),
just before it writes the request. So a call cut off by the client's overall deadline counts as "not sent"
only while it waited for a connection, and as maybe sent from then on (a connection acquired but not yet
written to counts as sent: never re-send on a guess).

Timeouts (``httpx.Timeout``, seconds) become ``aiohttp.ClientTimeout``: ``pool + connect`` bounds getting a
connection (aiohttp's ``connect`` covers waiting for the pool and connecting), ``connect`` the TCP connect,
``read`` each socket read (aiohttp starts it when the request is handed to the connection, so it also bounds the
write of these small bodies); aiohttp has no separate write timeout. The whole body is read inside the
transport, so every failure surfaces here, mapped.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import httpx
import yarl

#: Seconds an idle pooled connection is kept (httpx's default keep-alive expiry), well below the idle timeout
#: of common servers (aiohttp 75 s, nginx 75 s), so a request rarely meets a connection the server just closed.
KEEPALIVE_EXPIRY_S = 5.0

#: aiohttp exception type -> the httpx type raised for it; the first entry the exception is an instance of wins,
#: so subclasses come before their bases. See the module docstring for the reasoning.
EXCEPTION_MAP: tuple[tuple[type[BaseException], type[httpx.TransportError]], ...] = (
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.ClientConnectorError, httpx.ConnectError),
    (aiohttp.InvalidURL, httpx.UnsupportedProtocol),
    (aiohttp.NonHttpUrlClientError, httpx.UnsupportedProtocol),
    (aiohttp.ServerTimeoutError, httpx.ReadTimeout),
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),
    (aiohttp.ClientResponseError, httpx.RemoteProtocolError),
    (aiohttp.ClientPayloadError, httpx.ReadError),
    (aiohttp.ClientConnectionResetError, httpx.WriteError),
    (aiohttp.UploadAbortedError, httpx.WriteError),
    (aiohttp.ClientError, httpx.ReadError),
    (TimeoutError, httpx.ReadTimeout),
)


def httpx_error_for(exc: BaseException, request: httpx.Request) -> httpx.TransportError | None:
    """The httpx exception standing for aiohttp's ``exc`` (see the module docstring), or None when ``exc`` is
    not an HTTP failure (a programming error or a cancellation, left to propagate as it is)."""
    for source, target in EXCEPTION_MAP:
        if isinstance(exc, source):
            return target(f"{type(exc).__name__}: {exc}", request=request)
    return None


#: The trace event httpcore sends when it starts writing a request (the one the remote client watches).
SEND_STARTED = "http11.send_request_headers.started"


async def _connection_acquired(session: aiohttp.ClientSession, context: Any, params: Any) -> None:
    trace = getattr(context, "trace_request_ctx", None)
    if trace is not None:
        await trace(SEND_STARTED, {})


def _trace_config() -> aiohttp.TraceConfig:
    config = aiohttp.TraceConfig()
    config.on_connection_create_end.append(_connection_acquired)
    config.on_connection_reuseconn.append(_connection_acquired)
    config.freeze()
    return config


def _client_timeout(timeout: dict[str, float | None]) -> aiohttp.ClientTimeout:
    connect, pool = timeout.get("connect"), timeout.get("pool")
    acquire = None if connect is None or pool is None else connect + pool
    return aiohttp.ClientTimeout(total=None, connect=acquire, sock_connect=connect, sock_read=timeout.get("read"))


class AiohttpTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncBaseTransport`` over one ``aiohttp.ClientSession`` (HTTP/1.1, keep-alive pool).

    Args:
        max_connections: most connections open at once (aiohttp's ``limit``); requests beyond wait for one,
            within the request's pool timeout, then fail with ``httpx.ConnectTimeout`` (nothing sent).
        keepalive_expiry_s: seconds an idle connection stays in the pool.

    The session is created on the first request, inside the running event loop; :meth:`aclose` closes it.
    Cookies are not kept (httpx does that above the transport), redirects are not followed and bodies are passed
    through undecoded (httpx decodes ``Content-Encoding``), exactly as httpx's own transport does.
    """

    def __init__(self, *, max_connections: int, keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry_s = keepalive_expiry_s
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.max_connections, limit_per_host=0, keepalive_timeout=self.keepalive_expiry_s
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                trust_env=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                trace_configs=[_trace_config()],
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` and read the whole answer; failures raise the httpx types of the module docstring."""
        session = self._get_session()
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = await request.aread()
        extensions: dict[str, Any] = request.extensions
        try:
            async with session.request(
                request.method,
                yarl.URL(str(request.url), encoded=True),
                headers=request.headers.multi_items(),
                data=body or None,
                allow_redirects=False,
                compress=None,
                timeout=_client_timeout(extensions.get("timeout", {})),
                trace_request_ctx=extensions.get("trace"),
            ) as answer:
                content = await answer.read()
        except BaseException as exc:
            mapped = httpx_error_for(exc, request)
            if mapped is None:
                raise
            raise mapped from exc
        response_extensions: dict[str, Any] = {"http_version": b"HTTP/1.1"}
        if answer.reason:
            response_extensions["reason_phrase"] = answer.reason.encode("ascii", "replace")
        return httpx.Response(
            status_code=answer.status,
            headers=answer.raw_headers,
            content=content,
            request=request,
            extensions=response_extensions,
        )

    async def aclose(self) -> None:
        """Close the session and its pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None
