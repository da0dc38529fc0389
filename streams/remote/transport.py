"""An ``httpx`` transport backed by aiohttp: the httpx API for the remote client, aiohttp's cheaper HTTP/1.1
engine underneath (measured with ``streams bench``: docs/benchmark.md).

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

Answer size: a body is read chunk by chunk and decoded as it arrives (:class:`BoundedBody`: ``gzip``,
``x-gzip``, ``deflate``, ``identity``; other codings pass through as httpx leaves them), never holding more than
``max_answer_bytes`` of it, before or after decoding (a 2 MB gzip answer may expand to gigabytes). An answer
over the limit raises :class:`AnswerTooLargeError` (an ``httpx.DecodingError``: the request was sent and
answered, so the remote client classifies it as an answer that could not be read) and its connection is closed,
not reused. A ``Content-Length`` over the limit is refused before any byte of the body is read.
"""

from __future__ import annotations

import functools
import logging
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import Any

import aiohttp
import httpx
import yarl
from aiohttp.connector import Connection
from multidict import CIMultiDict

from streams.errors import error_summary

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
            return target(error_summary(exc), request=request)
    return None


#: The trace event httpcore sends when it starts writing a request (the one the remote client watches).
SEND_STARTED = "http11.send_request_headers.started"

#: An httpcore-style ``trace`` callback: ``await trace(event_name, info)``.
Trace = Callable[[str, dict[str, Any]], Awaitable[None]]

#: The ``trace`` callback of the request the current task is sending (set around each request): the connector
#: below reads it when it hands the request a connection. A context variable, because aiohttp calls
#: :meth:`_ReportingConnector.connect` inside the task that called ``session.request``, with no per-request slot
#: of ours on the way (aiohttp's own ``trace_configs`` make a ``Trace`` per request and a signal dispatch per
#: event, listened to or not: a cost the remote-call benchmark shows, docs/benchmark.md).
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


#: Default of ``Settings.remote_answer_max_bytes``: the most bytes of one answer's body kept, decoded.
DEFAULT_ANSWER_MAX_BYTES = 4 * 1024 * 1024


class AnswerTooLargeError(httpx.DecodingError):
    """An answer's body is over ``limit_bytes`` (as sent, or once decoded): it was not read to its end.

    An ``httpx.DecodingError``, so the remote client's table classifies it as an answer that could not be read
    (a POST: a job may exist; a GET: another poll with backoff). The message carries sizes, never the body.
    """

    def __init__(self, limit_bytes: int, what: str, request: httpx.Request | None = None) -> None:
        super().__init__(f"answer body over the {limit_bytes} byte limit ({what}); not read", request=request)
        self.limit_bytes = limit_bytes


class _Inflater:
    """One ``gzip``/``deflate`` layer, decoded incrementally: never more than ``room`` bytes out per call (zlib's
    ``max_length``), the rest of the input kept compressed in zlib's ``unconsumed_tail``. ``deflate`` is tried
    zlib-wrapped, then raw (RFC 9110 says wrapped; servers send both, httpx accepts both)."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self.raw_fallback = coding == "deflate"
        wbits = zlib.MAX_WBITS | 16 if coding in ("gzip", "x-gzip") else zlib.MAX_WBITS
        self.z = zlib.decompressobj(wbits)

    def pieces(self, data: bytes, room: int) -> list[bytes]:
        """``data`` decoded, in pieces of at most ``room`` bytes each; raises ``OverflowError`` as soon as the
        total passes ``room`` (the caller's remaining budget).

        Raises:
            httpx.DecodingError: the data is not of this coding.
        """
        out: list[bytes] = []
        total = 0
        while data and not self.z.eof:
            try:
                piece = self.z.decompress(data, room - total + 1)
            except zlib.error as exc:
                if self.raw_fallback:
                    self.raw_fallback = False
                    self.z = zlib.decompressobj(-zlib.MAX_WBITS)
                    continue
                raise httpx.DecodingError(f"{self.coding} answer does not decode: {exc}") from exc
            self.raw_fallback = False
            total += len(piece)
            if total > room:
                raise OverflowError
            out.append(piece)
            data = self.z.unconsumed_tail
        return out


class BoundedBody:
    """Reads one answer's body into at most ``limit_bytes`` bytes, decoding its ``Content-Encoding`` (a list of
    codings, in the order applied) as it comes.

    Codings: ``gzip``, ``x-gzip``, ``deflate``, ``identity``; any other passes through undecoded, as httpx
    leaves codings it has no decoder for. Every layer's output is bounded by ``limit_bytes`` too, so a nested
    bomb holds no more than the limit at any step.
    """

    def __init__(self, codings: Sequence[str], limit_bytes: int, request: httpx.Request | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.request = request
        names = [c.strip().lower() for value in codings for c in value.split(",")]
        self.layers = [_Inflater(c) for c in reversed(names) if c in ("gzip", "x-gzip", "deflate")]
        self.parts: list[bytes] = []
        self.size = 0
        self.received = 0

    def _too_large(self, what: str) -> AnswerTooLargeError:
        return AnswerTooLargeError(self.limit_bytes, what, self.request)

    def check_length(self, content_length: int | None) -> None:
        """Refuse a body announced (``Content-Length``) over the limit before reading it."""
        if content_length is not None and content_length > self.limit_bytes:
            raise self._too_large(f"Content-Length {content_length}")

    def feed(self, chunk: bytes) -> None:
        """Take the next ``chunk`` as received.

        Raises:
            AnswerTooLargeError: the body (received or decoded) passed the limit.
            httpx.DecodingError: the body does not decode.
        """
        self.received += len(chunk)
        if self.received > self.limit_bytes:
            raise self._too_large(f"more than {self.limit_bytes} bytes received")
        pieces = [chunk]
        for layer in self.layers:
            decoded: list[bytes] = []
            for piece in pieces:
                try:
                    decoded.extend(layer.pieces(piece, self.limit_bytes - self.size))
                except OverflowError:
                    raise self._too_large(f"{layer.coding} expands beyond it") from None
            pieces = decoded
        for piece in pieces:
            self.size += len(piece)
            if self.size > self.limit_bytes:
                raise self._too_large("decoded")
            self.parts.append(piece)

    def content(self) -> bytes:
        """The body read so far, decoded."""
        return b"".join(self.parts)

    async def read(self, chunks: AsyncIterator[bytes]) -> bytes:
        """Feed every chunk of ``chunks`` and return the decoded body (raises as :meth:`feed`)."""
        async for chunk in chunks:
            self.feed(chunk)
        return self.content()


def content_length(raw_headers: Any) -> int | None:
    """The answer's ``Content-Length`` as an int, None when absent or unreadable (aiohttp reads the body either
    way)."""
    for name, value in raw_headers:
        if name.lower() == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else None
    return None


def content_codings(raw_headers: Any) -> list[str]:
    """The answer's ``Content-Encoding`` values, as text."""
    return [value.decode("latin-1") for name, value in raw_headers if name.lower() == b"content-encoding"]


def make_response(
    status: int, reason: str | None, raw_headers: Any, content: bytes, request: httpx.Request | None
) -> httpx.Response:
    """The ``httpx.Response`` of a fully read answer whose body ``content`` is already decoded
    (:class:`BoundedBody`): handed over as it is, no decoder pass (httpx's ``Response(content=...)`` reads its
    own byte stream through the decoder machinery, ~10 µs). The headers are kept as received, ``Content-Encoding``
    included.
    """
    extensions: dict[str, Any] = {"http_version": b"HTTP/1.1"}
    if reason:
        extensions["reason_phrase"] = reason.encode("ascii", "replace")
    response = httpx.Response(
        status, headers=raw_headers, stream=httpx.ByteStream(content), request=request, extensions=extensions
    )
    response._content = content  # what Response.read() would set: the decoded bytes
    return response


class AiohttpTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncBaseTransport`` over one ``aiohttp.ClientSession`` (HTTP/1.1, keep-alive pool).

    Args:
        max_connections: most connections open at once (aiohttp's ``limit``); requests beyond wait for one,
            within the request's pool timeout, then fail with ``httpx.ConnectTimeout`` (nothing sent).
        keepalive_expiry_s: seconds an idle connection stays in the pool.
        ssl_context: TLS for ``https://`` (the provider's CA, a client certificate); None: the system's CAs.
        max_answer_bytes: most bytes of one answer's body read and kept, decoded (:class:`BoundedBody`).

    The session is created on the first request, inside the running event loop; :meth:`aclose` closes it.
    Cookies are not kept (httpx does that above the transport) and redirects are not followed, as httpx's own
    transport does; bodies are decoded here, within ``max_answer_bytes`` (the module docstring).
    """

    def __init__(
        self,
        *,
        max_connections: int,
        keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S,
        ssl_context: ssl.SSLContext | None = None,
        max_answer_bytes: int = DEFAULT_ANSWER_MAX_BYTES,
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry_s = keepalive_expiry_s
        self.ssl_context = ssl_context  # None: aiohttp's default (the system's CAs)
        self.max_answer_bytes = max_answer_bytes
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
        """Send one request and read the whole answer (decoded, at most :attr:`max_answer_bytes`): the remote
        client's path, without an ``httpx.Request``.

        ``url`` is absolute and already encoded; ``headers`` are sent as given (aiohttp adds ``Host`` and
        ``Content-Length`` when absent); ``timeouts`` come from :func:`client_timeout`; ``trace`` gets
        :data:`SEND_STARTED` once a connection is held for the request (see :class:`_ReportingConnector`);
        ``request`` is only attached to the answer and to the exceptions raised (without it, an exception gets
        one made of ``method`` and ``url``; the answer gets none).

        Raises:
            httpx.TransportError: the types of the module docstring.
            AnswerTooLargeError: the body is over :attr:`max_answer_bytes` (the connection is closed).
            httpx.DecodingError: the body does not decode as its ``Content-Encoding`` says.
        """
        session = self._get_session()
        token = _SENDING_TRACE.set(trace)
        try:
            async with session.request(
                method, url, headers=headers, data=body or None, allow_redirects=False, compress=None, timeout=timeouts
            ) as answer:
                reader = BoundedBody(content_codings(answer.raw_headers), self.max_answer_bytes, request)
                try:
                    reader.check_length(content_length(answer.raw_headers))
                    content = await reader.read(answer.content.iter_any())
                except httpx.DecodingError:
                    answer.close()  # the rest of the body is never read: the connection cannot be reused
                    raise
        except BaseException as exc:
            mapped = httpx_error_for(exc, request)
            if mapped is None:
                raise
            if request is None:
                mapped.request = httpx.Request(method, str(url))
            raise mapped from exc
        finally:
            _SENDING_TRACE.reset(token)
        return make_response(answer.status, answer.reason, answer.raw_headers, content, request)

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
