"""An ``httpx`` transport backed by aiohttp: the httpx API for the remote client, aiohttp's cheaper HTTP/1.1
engine underneath (measured with ``streams bench``: README, "Benchmark").

The remote client's error taxonomy (:mod:`streams.remote.client`) decides from the httpx exception type whether a
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

"Maybe" types are all outside :data:`streams.remote.client` ``_NOT_SENT``, so a POST that may have been sent is never
re-sent. httpx-aiohttp (PyPI) was not used for this reason: its table maps every ``ClientConnectionError``,
``ServerDisconnectedError`` included, to ``ConnectTimeout``, which would make a POST whose connection was lost
after sending look unsent, and the dispatcher would POST it again (a second remote job).

A pooled connection on which the server sent anything while it was idle is closed instead of reused: aiohttp
would read those bytes as the answer to the next request on it (a stray answer naming another job, and from then
on every answer one request late); httpcore makes the same choice (a readable idle connection has expired).

aiohttp itself never re-sends a POST: it retries a request once on a broken keep-alive connection only for
idempotent methods (``GET`` here, sequentially: still at most one GET in flight per job).

httpcore's ``trace`` request extension is honoured as far as the remote client needs it: the callback gets
``http11.send_request_headers.started`` as soon as aiohttp's connector hands the request a connection (new or
reused), just before aiohttp writes the request (:class:`_ReportingConnector`). So a call cut off by the
client's overall deadline counts as "not sent" only while it waited for a connection, and as maybe sent from
then on (a connection acquired but not yet written to counts as sent: never re-send on a guess).

The remote client calls :meth:`AiohttpTransport.send` directly with a URL, headers and timeouts it resolved
once; :meth:`AiohttpTransport.handle_async_request` (any other ``httpx.AsyncClient`` call) converts an
``httpx.Request`` and takes the same path.

Timeouts (``httpx.Timeout``, seconds) become ``aiohttp.ClientTimeout``: ``pool + connect`` bounds getting a
connection (aiohttp's ``connect`` covers waiting for the pool and connecting), ``connect`` the TCP connect,
``read`` each socket read (aiohttp starts it when the request is handed to the connection, so it also bounds the
write of these small bodies); aiohttp has no separate write timeout. The whole body is read inside the
transport, so every failure surfaces here, mapped.
"""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import Any

import aiohttp
import httpx
import yarl
from aiohttp.connector import Connection
from multidict import CIMultiDict

log = logging.getLogger(__name__)

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


def httpx_error_for(exc: BaseException, request: httpx.Request | None) -> httpx.TransportError | None:
    """The httpx exception standing for aiohttp's ``exc`` (see the module docstring), or None when ``exc`` is
    not an HTTP failure (a programming error or a cancellation, left to propagate as it is)."""
    for source, target in EXCEPTION_MAP:
        if isinstance(exc, source):
            return target(f"{type(exc).__name__}: {exc}", request=request)
    return None


#: The trace event httpcore sends when it starts writing a request (the one the remote client watches).
SEND_STARTED = "http11.send_request_headers.started"

#: An httpcore-style ``trace`` callback: ``await trace(event_name, info)``.
Trace = Callable[[str, dict[str, Any]], Awaitable[None]]

#: The ``trace`` callback of the request the current task is sending (set around each request): the connector
#: below reads it when it hands the request a connection. A context variable, because aiohttp calls
#: :meth:`_ReportingConnector.connect` inside the task that called ``session.request``, with no per-request slot
#: of ours on the way (aiohttp's own ``trace_configs`` cost 50-60 µs of CPU per request in the remote-call
#: benchmark, README "Benchmark": a ``Trace`` per request and a signal dispatch per event, listened to or not).
_SENDING_TRACE: ContextVar[Trace | None] = ContextVar("streams_transport_sending_trace", default=None)


class _ReportingConnector(aiohttp.TCPConnector):
    """aiohttp's TCP connector that reports :data:`SEND_STARTED` to the request's ``trace`` once it holds a
    connection for it (new or reused from the pool): aiohttp writes nothing before ``connect`` returns and starts
    writing right after (``ClientSession._request``: ``conn = await connector.connect(...)``, then
    ``req.send(conn)``, no other await between). Waiting for a pool slot, resolving and connecting all happen
    inside ``connect``: a cancellation there is "not sent"."""

    async def _wait_for_available_connection(self, key: Any, traces: Any) -> None:
        """aiohttp's wait for a free slot, made safe from a cancellation that lands after the wait was woken: aiohttp
        wakes one waiter per freed connection, and a waiter cancelled before it ran (its call deadline struck in the
        same loop turn, its caller gave up) took that wake-up with it, leaving the next waiter idle beside a free
        connection until another was freed or its own pool timeout struck (``ConnectTimeout``: "not sent"). The
        wake-up is passed on (a no-op when no connection is free)."""
        try:
            await super()._wait_for_available_connection(key, traces)
        except BaseException:
            self._release_waiter()
            raise

    async def connect(self, req: Any, traces: Any, timeout: aiohttp.ClientTimeout) -> Connection:  # noqa: ASYNC109 (aiohttp's signature)
        connection = await super().connect(req, traces, timeout)
        while connection.protocol is not None and connection.protocol.should_close:
            # A pooled connection on which the server sent bytes while it was idle (no request out: a stray or
            # repeated answer). aiohttp keeps them and would read them as the answer to the request about to be
            # written, and that request's own answer as the next one's: dropped, another connection taken.
            log.warning("HTTP pool: a kept-alive connection received data while idle; closed, not reused")
            connection.close()
            connection = await super().connect(req, traces, timeout)
        trace = _SENDING_TRACE.get()
        if trace is not None:
            try:
                await trace(SEND_STARTED, {})
            except BaseException:
                connection.release()
                raise
        return connection


def _client_timeout(timeout: dict[str, float | None]) -> aiohttp.ClientTimeout:
    connect, pool = timeout.get("connect"), timeout.get("pool")
    acquire = None if connect is None or pool is None else connect + pool
    return aiohttp.ClientTimeout(total=None, connect=acquire, sock_connect=connect, sock_read=timeout.get("read"))


@functools.lru_cache(maxsize=64)
def client_timeout(connect_s: float | None, read_s: float | None, pool_s: float | None) -> aiohttp.ClientTimeout:
    """The ``aiohttp.ClientTimeout`` for httpx's per-phase timeouts in seconds (see the module docstring),
    built once per distinct set (a worker uses one)."""
    return _client_timeout({"connect": connect_s, "read": read_s, "pool": pool_s})


def _response(
    status: int, reason: str | None, raw_headers: Any, content: bytes, request: httpx.Request | None
) -> httpx.Response:
    """The ``httpx.Response`` of a fully read answer, decoded as httpx decodes it.

    Without a ``Content-Encoding`` the body is the content as it is: it is handed over directly (httpx's
    ``Response(content=...)`` reads its own byte stream through the decoder machinery, ~10 µs). With one, httpx
    decodes it (gzip, deflate, ...) as its own transport's answers are.
    """
    extensions: dict[str, Any] = {"http_version": b"HTTP/1.1"}
    if reason:
        extensions["reason_phrase"] = reason.encode("ascii", "replace")
    if any(name.lower() == b"content-encoding" for name, _ in raw_headers):
        return httpx.Response(status, headers=raw_headers, content=content, request=request, extensions=extensions)
    response = httpx.Response(
        status, headers=raw_headers, stream=httpx.ByteStream(content), request=request, extensions=extensions
    )
    response._content = content  # what Response.read() would set: the same bytes, no decoder involved
    return response


class AiohttpTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncBaseTransport`` over one ``aiohttp.ClientSession`` (HTTP/1.1, keep-alive pool).

    Args:
        max_connections: most connections open at once (aiohttp's ``limit``); requests beyond wait for one,
            within the request's pool timeout, then fail with ``httpx.ConnectTimeout`` (nothing sent).
        keepalive_expiry_s: seconds an idle connection stays in the pool.
        ssl_context: TLS for ``https://`` (the provider's CA, a client certificate); None: the system's CAs.

    The session is created on the first request, inside the running event loop; :meth:`aclose` closes it.
    Cookies are not kept (httpx does that above the transport), redirects are not followed and bodies are passed
    through undecoded (httpx decodes ``Content-Encoding``), exactly as httpx's own transport does.
    """

    def __init__(
        self,
        *,
        max_connections: int,
        keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry_s = keepalive_expiry_s
        self.ssl_context = ssl_context  # None: aiohttp's default (the system's CAs)
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = _ReportingConnector(
                limit=self.max_connections,
                limit_per_host=0,
                keepalive_timeout=self.keepalive_expiry_s,
                ssl=self.ssl_context if self.ssl_context is not None else True,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                trust_env=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        return self._session

    async def send(
        self,
        method: str,
        url: yarl.URL,
        headers: CIMultiDict[str] | Sequence[tuple[str, str]],
        body: bytes | None,
        timeouts: aiohttp.ClientTimeout,
        trace: Trace | None = None,
        request: httpx.Request | None = None,
    ) -> httpx.Response:
        """Send one request and read the whole answer: the remote client's path, without an ``httpx.Request``.

        ``url`` is absolute and already encoded; ``headers`` are sent as given (aiohttp adds ``Host`` and
        ``Content-Length`` when absent); ``timeouts`` come from :func:`client_timeout`; ``trace`` gets
        :data:`SEND_STARTED` once a connection is held for the request (see :class:`_ReportingConnector`);
        ``request`` is only attached to the answer and to the exceptions raised (without it, an exception gets
        one made of ``method`` and ``url``; the answer gets none).

        Raises:
            httpx.TransportError: the types of the module docstring.
        """
        session = self._get_session()
        token = _SENDING_TRACE.set(trace)
        try:
            async with session.request(
                method, url, headers=headers, data=body or None, allow_redirects=False, compress=None, timeout=timeouts
            ) as answer:
                content = await answer.read()
        except BaseException as exc:
            mapped = httpx_error_for(exc, request)
            if mapped is None:
                raise
            if request is None:
                mapped.request = httpx.Request(method, str(url))
            raise mapped from exc
        finally:
            _SENDING_TRACE.reset(token)
        return _response(answer.status, answer.reason, answer.raw_headers, content, request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` and read the whole answer; failures raise the httpx types of the module docstring."""
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = await request.aread()
        extensions: dict[str, Any] = request.extensions
        timeout: dict[str, float | None] = extensions.get("timeout", {})
        return await self.send(
            request.method,
            yarl.URL(str(request.url), encoded=True),
            request.headers.multi_items(),
            body,
            client_timeout(timeout.get("connect"), timeout.get("read"), timeout.get("pool")),
            extensions.get("trace"),
            request,
        )

    async def aclose(self) -> None:
        """Close the session and its pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None
