"""The aiohttp -> httpx exception mapping of :mod:`streams.remote.transport`, class by class: what may have been sent
must
never look unsent to the remote client's taxonomy (a POST that looks unsent is sent again)."""

from __future__ import annotations

import asyncio
import gzip
from types import SimpleNamespace

import aiohttp
import httpx
import pytest
import yarl
from multidict import CIMultiDict, CIMultiDictProxy

from streams.remote.client import _NOT_SENT
from streams.remote.transport import (
    EXCEPTION_MAP,
    BoundedBody,
    _client_timeout,
    client_timeout,
    httpx_error_for,
    make_response,
)

REQUEST = httpx.Request("POST", "http://127.0.0.1:1/v1/generations")
INFO = aiohttp.RequestInfo(
    yarl.URL(str(REQUEST.url)), "POST", CIMultiDictProxy(CIMultiDict()), yarl.URL(str(REQUEST.url))
)
KEY = SimpleNamespace(host="127.0.0.1", port=1, ssl=True, is_ssl=False)


def connector_error(cls: type[aiohttp.ClientConnectorError] = aiohttp.ClientConnectorError) -> BaseException:
    # KEY stands in for aiohttp's ConnectionKey, whose fields differ between aiohttp releases
    return cls(KEY, ConnectionRefusedError(111, "Connection refused"))  # type: ignore[arg-type]


NOT_SENT: list[tuple[BaseException, type[httpx.TransportError]]] = [
    (connector_error(), httpx.ConnectError),
    (connector_error(aiohttp.ClientConnectorDNSError), httpx.ConnectError),
    (connector_error(aiohttp.ClientProxyConnectionError), httpx.ConnectError),
    (aiohttp.ConnectionTimeoutError("Connection timeout to host"), httpx.ConnectTimeout),
    (aiohttp.InvalidUrlClientError("ftp://x"), httpx.UnsupportedProtocol),
    (aiohttp.NonHttpUrlClientError("ftp://x"), httpx.UnsupportedProtocol),
]

MAYBE_SENT: list[tuple[BaseException, type[httpx.TransportError]]] = [
    (aiohttp.ServerDisconnectedError(), httpx.RemoteProtocolError),
    (aiohttp.SocketTimeoutError("Timeout on reading data from socket"), httpx.ReadTimeout),
    (aiohttp.ServerTimeoutError("timeout"), httpx.ReadTimeout),
    (TimeoutError(), httpx.ReadTimeout),
    (aiohttp.ClientPayloadError("Response payload is not completed"), httpx.ReadError),
    (aiohttp.ClientOSError(104, "Connection reset by peer"), httpx.ReadError),
    (aiohttp.ClientConnectionResetError("Cannot write to closing transport"), httpx.WriteError),
    (aiohttp.UploadAbortedError("body not sent"), httpx.WriteError),
    (aiohttp.ClientConnectionError("lost"), httpx.ReadError),
    (aiohttp.ClientResponseError(INFO, (), status=400, message="Invalid response status"), httpx.RemoteProtocolError),
    (aiohttp.ClientError("anything else"), httpx.ReadError),
]


@pytest.mark.parametrize(
    ("exc", "expected"), NOT_SENT, ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else ""
)
def test_failures_before_any_byte_map_to_not_sent_types(exc: BaseException, expected: type[Exception]) -> None:
    mapped = httpx_error_for(exc, REQUEST)
    assert type(mapped) is expected
    assert isinstance(mapped, _NOT_SENT)
    assert mapped.request is REQUEST
    assert type(exc).__name__ in str(mapped)


@pytest.mark.parametrize(
    ("exc", "expected"), MAYBE_SENT, ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else ""
)
def test_failures_after_sending_began_never_look_unsent(exc: BaseException, expected: type[Exception]) -> None:
    mapped = httpx_error_for(exc, REQUEST)
    assert type(mapped) is expected
    assert not isinstance(mapped, _NOT_SENT)
    assert isinstance(mapped, httpx.TransportError)


def test_server_disconnected_is_not_a_connect_timeout() -> None:
    # httpx-aiohttp maps every ClientConnectionError (this one included) to ConnectTimeout: a POST whose
    # connection dropped after sending would be re-sent.
    assert aiohttp.ServerDisconnectedError.__mro__.index(aiohttp.ClientConnectionError) > 0
    assert not isinstance(httpx_error_for(aiohttp.ServerDisconnectedError(), REQUEST), httpx.ConnectTimeout)


@pytest.mark.parametrize("exc", [asyncio.CancelledError(), ValueError("a bug"), KeyError("k")])
def test_non_http_failures_are_not_mapped(exc: BaseException) -> None:
    assert httpx_error_for(exc, REQUEST) is None


def test_every_entry_is_reachable() -> None:
    # An entry shadowed by an earlier base class would never apply.
    for i, (later, _) in enumerate(EXCEPTION_MAP):
        for earlier, _ in EXCEPTION_MAP[:i]:
            assert not issubclass(later, earlier), f"{later.__name__} is shadowed by {earlier.__name__}"


def test_timeouts_map_onto_aiohttp_fields() -> None:
    timeout = _client_timeout({"connect": 2.0, "read": 10.0, "write": 5.0, "pool": 5.0})
    assert (timeout.total, timeout.connect, timeout.sock_connect, timeout.sock_read) == (None, 7.0, 2.0, 10.0)
    unbounded = _client_timeout({"connect": None, "read": None, "write": None, "pool": None})
    assert (unbounded.total, unbounded.connect, unbounded.sock_connect, unbounded.sock_read) == (None,) * 4
    assert client_timeout(2.0, 10.0, 5.0) is client_timeout(2.0, 10.0, 5.0)  # built once per set
    assert client_timeout(2.0, 10.0, 5.0) == timeout


BODY = b'{"id":"job1","n":1.50,"text":"caf\xc3\xa9"}'


@pytest.mark.parametrize(
    ("headers", "content"),
    [
        ([(b"Content-Type", b"application/json"), (b"Retry-After", b"3")], BODY),
        ([(b"Content-Type", b"application/json; charset=latin-1")], "café".encode("latin-1")),
        ([(b"Content-Type", b"application/json"), (b"Content-Encoding", b"gzip")], gzip.compress(BODY)),
        ([(b"content-encoding", b"gzip")], gzip.compress(BODY)),
        ([], b""),
    ],
    ids=["plain", "latin-1", "gzip", "gzip-lowercase", "empty"],
)
def test_an_answer_reads_as_httpx_reads_its_own(headers: list[tuple[bytes, bytes]], content: bytes) -> None:
    # The transport decodes the body as it reads it (BoundedBody) and hands it to httpx with no decoder pass; what
    # the remote client reads of it (status, headers, bytes, text, reason) must be what httpx's own
    # Response(content=...) gives, an encoded body decoded.
    decoded = BoundedBody([v.decode() for k, v in headers if k.lower() == b"content-encoding"], 1 << 20)
    decoded.feed(content)
    ours = make_response(201, "Created", headers, decoded.content(), REQUEST)
    expected = httpx.Response(201, headers=headers, content=content, request=REQUEST)
    assert ours.content == expected.content
    assert ours.text == expected.text
    assert ours.status_code == 201 and ours.reason_phrase == "Created"
    assert ours.headers.get("Retry-After") == expected.headers.get("Retry-After")
    assert ours.request is REQUEST
    assert ours.http_version == "HTTP/1.1"
    if any(name.lower() == b"content-encoding" for name, _ in headers):
        assert ours.content == BODY


async def test_an_answer_is_read_and_closed() -> None:
    response = make_response(200, None, [], BODY, None)
    assert await response.aread() == BODY
    await response.aclose()
    assert response.is_closed and response.reason_phrase == "OK"
