"""Misbehaving HTTP peers on real loopback sockets, for the remote client's deadline and pool tests.

:class:`TricklingProxy` sits between a client and the simulator and counts, per remote job, the GETs it is
serving (a GET is in flight from the arrival of its request until its whole answer was delivered or the client
went away, noticed like a real server does: by a failing write). It can trickle chosen answers one byte at a
time, each byte well within the client's read timeout, so only an overall deadline can end the call.

:class:`FlakyProvider` is a minimal generation API that can turn slow and reset connections for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import struct
import uuid
import zlib
from collections import Counter

import orjson

_JOB_GET = re.compile(rb"^GET /v1/generations/([^ ?]+) ")
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


class PeerGone(Exception):
    """The other side closed the connection."""


async def read_message(reader: asyncio.StreamReader) -> bytes | None:
    """One HTTP/1.1 message (head and a ``Content-Length`` body), or None when the peer closed cleanly first."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise PeerGone() from exc
        return None
    match = _CONTENT_LENGTH.search(head)
    body = await reader.readexactly(int(match.group(1))) if match else b""
    return head + body


class TricklingProxy:
    """HTTP/1.1 proxy on a loopback port in front of ``upstream_port``.

    ``trickle_get(job_id, times)`` makes the next ``times`` answers to GETs of that job arrive one byte every
    ``byte_interval_s``; ``trickle_posts`` does that to every POST answer. ``max_in_flight[job_id]`` is the most
    GETs of that job the proxy was serving at once; ``trickled`` lists the jobs whose answer was trickled.
    """

    def __init__(self, upstream_port: int, byte_interval_s: float) -> None:
        self.upstream_port = upstream_port
        self.byte_interval_s = byte_interval_s
        self.trickle_posts = False
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.trickled: list[str] = []
        self._trickle_next: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def trickle_get(self, job_id: str, times: int = 1) -> None:
        self._trickle_next[job_id] += times

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            while (request := await read_message(reader)) is not None:
                match = _JOB_GET.match(request)
                job = match.group(1).decode() if match else None
                if job is not None:
                    self.in_flight[job] += 1
                    self.max_in_flight[job] = max(self.max_in_flight[job], self.in_flight[job])
                try:
                    up_writer.write(request)
                    await up_writer.drain()
                    answer = await read_message(up_reader)
                    if answer is None:
                        raise PeerGone()
                    if (job is not None and self._trickle_next[job] > 0) or (
                        job is None and self.trickle_posts and request.startswith(b"POST ")
                    ):
                        if job is not None:
                            self._trickle_next[job] -= 1
                            self.trickled.append(job)
                        await self._trickle(writer, answer)
                    else:
                        writer.write(answer)
                        await writer.drain()
                finally:
                    if job is not None:
                        self.in_flight[job] -= 1
        except (PeerGone, ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the peer left, or the proxy is stopping
        finally:
            self._handlers.discard(task)
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    async def _trickle(self, writer: asyncio.StreamWriter, answer: bytes) -> None:
        """Write ``answer`` one byte per interval; a failing write means the client left (as a server sees it)."""
        for i in range(len(answer)):
            writer.write(answer[i : i + 1])
            await writer.drain()
            await asyncio.sleep(self.byte_interval_s)


class FlakyProvider:
    """A minimal generation API on a loopback port (raw asyncio, HTTP/1.1 keep-alive).

    Healthy: ``POST /v1/generations`` answers 201 with a new job id, ``GET /v1/generations/{id}`` answers 200
    ``running`` at once. During a storm (:meth:`storm_on` / :meth:`storm_off`) it still accepts connections
    and reads requests, but resets ``reset_rate`` of them (RST, after up to ``reset_within_s``) and answers the
    rest only after ``slow_s``. ``posts_seen`` holds the operation ids (``metadata.client_reference``) of every
    POST it read, ``received`` counts the requests read by method, ``served`` the answers by kind (ok, slow,
    reset).
    """

    def __init__(self, *, slow_s: float = 10.0, reset_rate: float = 0.2, reset_within_s: float = 1.0) -> None:
        self.slow_s = slow_s
        self.reset_rate = reset_rate
        self.reset_within_s = reset_within_s
        self.storm = False
        self.posts_seen: set[str] = set()
        self.received: Counter[str] = Counter()  # requests read, by method
        self.served: Counter[str] = Counter()
        self._random = random.Random(2026)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close_listener(self) -> None:
        """Refuse new connections (the port is closed); connections already open stay."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def stop(self) -> None:
        await self.close_listener()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while (request := await read_message(reader)) is not None:
                self.received[request.split(b" ", 1)[0].decode()] += 1
                if request.startswith(b"POST "):
                    body = orjson.loads(request.split(b"\r\n\r\n", 1)[1])
                    self.posts_seen.add(str(body["metadata"]["client_reference"]))
                if self.storm:
                    if self._random.random() < self.reset_rate:
                        await asyncio.sleep(self._random.uniform(0.0, self.reset_within_s))
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        writer.transport.abort()  # RST: the connection is reset under the client
                        self.served["reset"] += 1
                        return
                    await asyncio.sleep(self.slow_s)
                    self.served["slow"] += 1
                else:
                    self.served["ok"] += 1
                writer.write(self._answer(request))
                await writer.drain()
        except (PeerGone, ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._handlers.discard(task)
            writer.close()

    def _answer(self, request: bytes) -> bytes:
        body: dict[str, object]
        if request.startswith(b"POST "):
            status, body = "201 Created", {"id": f"job-{uuid.uuid4().hex[:12]}", "status": "queued"}
        else:
            job = request.split(b" ", 2)[1].rsplit(b"/", 1)[1].decode()
            status, body = "200 OK", {"id": job, "status": "running", "outputs": [], "poll_after_ms": 100}
        data = orjson.dumps(body)
        head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        return head.encode() + data


#: A well-formed small answer to a POST (the job ``job1``) and to its GET.
_CREATED = b'HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{"id":"job1"}'
_RUNNING = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 33\r\n\r\n{"id":"job1","status":"running"}\n'
)


class GzipBomb:
    """A loopback generation API whose first ``good`` answers are well-formed (a POST's 201, a GET's 200) and
    every later one a gzip answer of ``expanded_bytes`` zeros (chunked; about a thousandth of that on the wire),
    generated as it is sent (``zlib.compressobj`` over repeated zero chunks, never held whole). ``sent_bytes``
    counts the compressed bytes written before the client stopped reading; ``answers`` the answers begun."""

    def __init__(self, expanded_bytes: int, good: int = 2) -> None:
        self.expanded_bytes = expanded_bytes
        self.good = good
        self.answers = 0
        self.sent_bytes = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> GzipBomb:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (message := await read_message(reader)) is not None:
                self.answers += 1
                if self.answers <= self.good:
                    writer.write(_CREATED if message.startswith(b"POST") else _RUNNING)
                    await writer.drain()
                    continue
                status = b"201 Created" if message.startswith(b"POST") else b"200 OK"
                await self._bomb(writer, status)
        except (PeerGone, ConnectionError):
            pass
        finally:
            writer.close()

    async def _bomb(self, writer: asyncio.StreamWriter, status: bytes) -> None:
        writer.write(
            b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        # After a full flush the compressor forgets its history, so every further MiB of zeros compresses to the
        # same bytes: computed once, then repeated (cheap to send however far it expands).
        compressor = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
        zeros = bytes(1 << 20)
        first = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
        again = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
        chunks = self.expanded_bytes // len(zeros)
        await self._chunk(writer, first)
        for _ in range(chunks - 1):
            await self._chunk(writer, again)
        crc = 0
        for _ in range(chunks):  # reached only by a client that read it all
            crc = zlib.crc32(zeros, crc)
        end = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS).flush()  # an empty final block
        await self._chunk(writer, end + struct.pack("<II", crc, (chunks * len(zeros)) & 0xFFFFFFFF))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _chunk(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if writer.is_closing():  # the client stopped reading: generate no more
            raise PeerGone()
        if data:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.sent_bytes += len(data)
            await writer.drain()
