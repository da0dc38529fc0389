"""The aiohttp transport under the remote client, over real loopback sockets: each way a request can fail ends on
the side of the taxonomy it belongs to (not sent: retried; maybe sent: never re-sent), and a good answer reads
exactly as it does through httpx's own transport."""

from __future__ import annotations

import asyncio
import gzip
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import httpx
import orjson
import pytest
import yarl

from streams.config import Settings
from streams.errors import RemoteNotSentError, RemoteTransientError, RemoteUnknownOutcomeError
from streams.remote.client import RemoteClient, make_http_client
from streams.remote.transport import AiohttpTransport, client_timeout

pytestmark = pytest.mark.integration

OP = "operation-42"
#: A provider request (JSON text) as a submission carries it.
REQUEST = '{"input": {"prompt": "a short prompt", "max_tokens": 2}}'
CREATED = b'HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{"id":"job1"}'

#: What the scripted server does once it has read one request: gets (reader, writer), returns nothing.
Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class ScriptedServer:
    """A loopback HTTP/1.1 server that answers request number ``i`` with ``behaviours[i]`` (the last repeats)
    and records each request's head and body."""

    def __init__(self, *behaviours: Behaviour) -> None:
        self.behaviours = behaviours
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                self.requests.append((head, body))
                behaviour = self.behaviours[min(len(self.requests), len(self.behaviours)) - 1]
                await behaviour(reader, writer)
                if writer.is_closing():
                    return
        finally:
            writer.close()

    def posts(self) -> int:
        return sum(1 for head, _ in self.requests if head.startswith(b"POST "))


def answer(raw: bytes) -> Behaviour:
    async def behave(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(raw)
        await writer.drain()

    return behave


async def close_silently(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


def settings_for(url: str, **changes: object) -> Settings:
    values: dict[str, object] = {"http_read_timeout_s": 0.5, "http_transport": "aiohttp", **changes}
    return Settings(remote_base_url=url, **values)


@pytest.fixture
async def clients() -> AsyncIterator[Callable[[Settings], RemoteClient]]:
    made: list[RemoteClient] = []

    def make(settings: Settings) -> RemoteClient:
        client = RemoteClient.from_settings(settings)
        assert isinstance(client.http._transport, AiohttpTransport)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.aclose()


def free_closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_connection_refused_is_not_sent(clients: Callable[[Settings], RemoteClient]) -> None:
    client = clients(settings_for(f"http://127.0.0.1:{free_closed_port()}"))
    with pytest.raises(RemoteNotSentError) as info:
        await client.submit(OP, REQUEST)
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert isinstance(info.value.__cause__.__cause__, aiohttp.ClientConnectorError)
    failed = info.value.__cause__.request  # httpx errors name their request, on the direct path too
    assert (failed.method, failed.url.path) == ("POST", "/v1/generations")


async def test_no_free_pooled_connection_is_not_sent(clients: Callable[[Settings], RemoteClient]) -> None:
    async with ScriptedServer(never_answer) as server:
        client = clients(
            settings_for(
                server.url,
                dispatcher_concurrency=1,
                observer_concurrency=1,  # a pool of 2 connections
                http_pool_timeout_s=0.2,
                http_read_timeout_s=5.0,
            )
        )
        first = [asyncio.create_task(client.submit(f"op-first-{i}", REQUEST)) for i in range(2)]
        while len(server.requests) < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(RemoteNotSentError) as info:
            await client.submit(OP, REQUEST)
        assert isinstance(info.value.__cause__, httpx.ConnectTimeout)
        assert isinstance(info.value.__cause__.__cause__, aiohttp.ConnectionTimeoutError)
        assert server.posts() == 2  # only the first two reached the server
        for task in first:
            task.cancel()


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh-connection", "kept-alive-connection"])
async def test_connection_closed_after_the_post_is_unknown_and_sent_once(
    clients: Callable[[Settings], RemoteClient], reuse: bool
) -> None:
    warm = answer(b'HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n{"status":"running"}')
    behaviours = (warm, close_silently) if reuse else (close_silently,)
    async with ScriptedServer(*behaviours) as server:
        client = clients(settings_for(server.url))
        if reuse:
            await client.observe(OP, "job1")
        with pytest.raises(RemoteUnknownOutcomeError, match="connection lost after send") as info:
            await client.submit(OP, REQUEST)
        assert isinstance(info.value.__cause__, httpx.RemoteProtocolError)
        assert isinstance(info.value.__cause__.__cause__, aiohttp.ServerDisconnectedError)
        await asyncio.sleep(0.2)
        assert server.posts() == 1  # aiohttp does not re-send a POST
        assert server.connections == 1


async def test_connection_reset_after_the_post_is_unknown(clients: Callable[[Settings], RemoteClient]) -> None:
    async with ScriptedServer(reset) as server:
        client = clients(settings_for(server.url))
        with pytest.raises(RemoteUnknownOutcomeError) as info:
            await client.submit(OP, REQUEST)
        assert not isinstance(info.value, RemoteNotSentError)
        assert isinstance(info.value.__cause__, httpx.TransportError)
        assert server.posts() == 1


async def test_no_answer_within_the_read_timeout_is_unknown(clients: Callable[[Settings], RemoteClient]) -> None:
    async with ScriptedServer(never_answer) as server:
        client = clients(settings_for(server.url))
        with pytest.raises(RemoteUnknownOutcomeError, match="timed out after send") as info:
            await client.submit(OP, REQUEST)
        assert isinstance(info.value.__cause__, httpx.ReadTimeout)
        assert isinstance(info.value.__cause__.__cause__, aiohttp.SocketTimeoutError)


async def test_body_cut_short_is_unknown(clients: Callable[[Settings], RemoteClient]) -> None:
    cut = b'HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n{"id":"jo'
    async with ScriptedServer(lambda r, w: _then_close(w, cut)) as server:
        client = clients(settings_for(server.url))
        with pytest.raises(RemoteUnknownOutcomeError) as info:
            await client.submit(OP, REQUEST)
        assert isinstance(info.value.__cause__, httpx.ReadError)
        assert isinstance(info.value.__cause__.__cause__, aiohttp.ClientPayloadError)


async def test_garbage_instead_of_http_is_unknown(clients: Callable[[Settings], RemoteClient]) -> None:
    async with ScriptedServer(lambda r, w: _then_close(w, b"SSH-2.0-OpenSSH_9.2\r\n\r\n")) as server:
        client = clients(settings_for(server.url))
        with pytest.raises(RemoteUnknownOutcomeError) as info:
            await client.submit(OP, REQUEST)
        assert isinstance(info.value.__cause__, httpx.RemoteProtocolError)


async def test_call_deadline_while_waiting_for_a_connection_is_not_sent(
    clients: Callable[[Settings], RemoteClient],
) -> None:
    async with ScriptedServer(never_answer) as server:
        client = clients(
            settings_for(
                server.url,
                dispatcher_concurrency=1,
                observer_concurrency=1,
                http_pool_timeout_s=10.0,
                http_read_timeout_s=10.0,
                remote_call_deadline_s=0.5,
            )
        )
        # both pooled connections held by unanswered GETs (made below the client's deadline)
        busy = [asyncio.create_task(client.http.get("/v1/generations/job1")) for _ in range(2)]
        while len(server.requests) < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(RemoteNotSentError, match="deadline"):
            await client.submit(OP, REQUEST)
        assert server.posts() == 0
        for task in busy:
            task.cancel()


async def test_call_deadline_after_sending_is_unknown(clients: Callable[[Settings], RemoteClient]) -> None:
    async with ScriptedServer(never_answer) as server:
        client = clients(settings_for(server.url, http_read_timeout_s=10.0, remote_call_deadline_s=0.5))
        with pytest.raises(RemoteUnknownOutcomeError, match="timed out after send"):
            await client.submit(OP, REQUEST)
        assert server.posts() == 1


async def test_get_failures_are_transient(clients: Callable[[Settings], RemoteClient]) -> None:
    async with ScriptedServer(close_silently) as server:
        client = clients(settings_for(server.url))
        with pytest.raises(RemoteTransientError):
            await client.observe(OP, "job1")
    client = clients(settings_for(f"http://127.0.0.1:{free_closed_port()}"))
    with pytest.raises(RemoteTransientError):
        await client.observe(OP, "job1")


async def _then_close(writer: asyncio.StreamWriter, raw: bytes) -> None:
    writer.write(raw)
    await writer.drain()
    writer.close()


async def test_a_good_answer_reads_as_through_httpx(clients: Callable[[Settings], RemoteClient]) -> None:
    body = gzip.compress(orjson.dumps({"status": "succeeded", "outputs": [{"id": "o1"}], "completed_at": 1.5}))
    raw = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nRetry-After: 3\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    async with ScriptedServer(answer(CREATED), answer(raw)) as server:
        host = server.url.removeprefix("http://").encode()
        client = clients(settings_for(server.url))
        created = await client.submit(OP, REQUEST)
        snapshot = await client.observe(OP, "a/../b?x=1#")
    assert (created.job_id, created.status_code, created.via_error) == ("job1", 201, False)
    assert snapshot.outputs == [{"id": "o1"}] and snapshot.completed_at_ms == 1500 and snapshot.poll_after_s == 3.0
    (post_head, post_body), (get_head, _) = server.requests
    assert post_head.startswith(b"POST /v1/generations HTTP/1.1\r\n")
    assert orjson.loads(post_body)["metadata"] == {"client_reference": OP}
    headers = {
        k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in post_head.split(b"\r\n")[1:]) if k
    }
    assert headers[b"authorization"] == b"Bearer dev-key"
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"user-agent"] == b"generation-streams/0.1"
    assert headers[b"host"] == host
    assert get_head.startswith(b"GET /v1/generations/a%2F..%2Fb%3Fx%3D1%23 HTTP/1.1\r\n")
    assert server.connections == 1  # kept alive between the two requests


async def test_the_httpx_setting_keeps_httpcore(clients: Callable[[Settings], RemoteClient]) -> None:
    http = make_http_client(Settings(http_transport="httpx"))
    try:
        assert not isinstance(http._transport, AiohttpTransport)
    finally:
        await http.aclose()


def request_head(head: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The request line and the header fields (names lower-cased, sorted) of one request head."""
    line, *fields = head.rstrip(b"\r\n").split(b"\r\n")
    return line, sorted((k.strip().lower(), v.strip()) for k, _, v in (f.partition(b":") for f in fields))


async def test_the_remote_client_sends_what_httpx_sends() -> None:
    # With the aiohttp transport the client skips httpx's request building (URLs and headers resolved once,
    # the transport called directly): the provider must receive the same requests as through httpx's own stack.
    body = b'{"id":"job1","status":"running"}'
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 32\r\n\r\n" + body
    async with ScriptedServer(answer(reply)) as server:
        for transport in ("httpx", "aiohttp"):
            client = RemoteClient.from_settings(Settings(remote_base_url=server.url, http_transport=transport))
            try:
                assert (client._aiohttp is not None) == (transport == "aiohttp")
                await client.submit(OP, REQUEST)
                await client.observe(OP, "job1")
            finally:
                await client.aclose()
    (httpx_post, httpx_post_body), (httpx_get, _), (ours_post, ours_post_body), (ours_get, _) = server.requests
    assert request_head(ours_post) == request_head(httpx_post)
    assert ours_post_body == httpx_post_body
    assert request_head(ours_get) == request_head(httpx_get)
    assert request_head(ours_get)[0] == b"GET /v1/generations/job1 HTTP/1.1"


#: An answer that says gzip and is not: httpx cannot decode its body (``httpx.DecodingError``).
BAD_GZIP = b"HTTP/1.1 201 Created\r\nContent-Encoding: gzip\r\nContent-Length: 13\r\n\r\n" + b'{"id":"job1"}'


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_an_answer_that_cannot_be_decoded_is_classified(transport: str) -> None:
    # The POST was sent and answered: whatever the status, a job may exist (never re-sent, never unclassified);
    # a GET so answered is retried like any other unreadable answer.
    async with ScriptedServer(answer(BAD_GZIP)) as server:
        client = RemoteClient.from_settings(settings_for(server.url, http_transport=transport))
        try:
            with pytest.raises(RemoteUnknownOutcomeError, match="answer could not be read") as info:
                await client.submit(OP, REQUEST)
            assert not isinstance(info.value, RemoteNotSentError)
            assert isinstance(info.value.__cause__, httpx.DecodingError)
            with pytest.raises(RemoteTransientError):
                await client.observe(OP, "job1")
        finally:
            await client.aclose()
    assert server.posts() == 1


async def test_a_waiter_cancelled_as_it_is_woken_passes_the_free_connection_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # One pooled connection, held by a slow GET; A and B wait for it. When it comes free, aiohttp wakes A, and A
    # is cancelled before it runs (its call deadline or its caller, in the same loop turn): B must get the
    # connection then, not wait idle beside it until its own pool timeout ("not sent" against a healthy server).
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.3)
        await answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")(reader, writer)

    quick = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    async with ScriptedServer(slow, quick) as server:
        transport = AiohttpTransport(max_connections=1)
        timeouts = client_timeout(5.0, 5.0, 5.0)  # a 10 s wait for a connection before ConnectTimeout

        async def get() -> httpx.Response:
            return await transport.send("GET", yarl.URL(server.url + "/v1/generations/j"), [], None, timeouts)

        try:
            holder = asyncio.create_task(get())
            while not server.requests:
                await asyncio.sleep(0.01)
            a = asyncio.create_task(get())
            await asyncio.sleep(0.05)
            b = asyncio.create_task(get())
            await asyncio.sleep(0.05)
            connector = transport._get_session().connector
            assert connector is not None
            wake = connector._release_waiter

            def wake_then_cancel_the_woken() -> None:  # the cancellation lands between A's wake-up and its run
                wake()
                if not a.done():
                    a.cancel()

            monkeypatch.setattr(connector, "_release_waiter", wake_then_cancel_the_woken)
            assert (await holder).status_code == 200
            with pytest.raises(asyncio.CancelledError):
                await a
            assert (await asyncio.wait_for(b, 2.0)).status_code == 200
        finally:
            await transport.aclose()


def _created(job_id: str) -> bytes:
    body = orjson.dumps({"id": job_id})
    return b"HTTP/1.1 201 Created\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_an_answer_sent_on_an_idle_connection_is_never_taken_for_the_next_requests(transport: str) -> None:
    # The provider (or a box on the way) answers the first POST, then, while the connection idles in the pool,
    # sends one more answer nobody asked for. The next POST must get its own answer, not that stray one (which
    # named another job: the operation would have been bound to it, and every later call on the connection to
    # its predecessor's answer).
    async def answer_then_a_stray_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer(_created("job1"))(reader, writer)
        await asyncio.sleep(0.05)
        await answer(_created("job-stray"))(reader, writer)

    async with ScriptedServer(answer_then_a_stray_one, answer(_created("job2"))) as server:
        client = RemoteClient.from_settings(settings_for(server.url, http_transport=transport))
        try:
            assert (await client.submit("op-1", REQUEST)).job_id == "job1"
            await asyncio.sleep(0.2)  # the stray answer has arrived on the idle connection
            assert (await client.submit("op-2", REQUEST)).job_id == "job2"
        finally:
            await client.aclose()
    assert server.posts() == 2
