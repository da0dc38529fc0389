"""Every failed GET counts toward the job's backoff and, ``failed_poll_limit`` times in a row, ends in ``stalled``:
against a real loopback provider answering each failing kind, the real ledger and Redis (docs/provider-edges.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from streams.model.answers import JobSnapshot
from streams.model.codes import ReasonCode
from streams.model.states import OperationState
from streams.remote.client import RemoteClient
from streams.worker.runtime import Runtime
from tests.integration.stuck import operation, poll_now, request_text
from tests.integration.test_transport import free_closed_port

pytestmark = pytest.mark.integration

#: Failing answers to ``GET /v1/generations/job-x`` (raw HTTP/1.1), each classified as a retryable failure.
ANSWERS = {
    "503": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
    "302": b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:1/elsewhere\r\nContent-Length: 0\r\n\r\n",
    "html": b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 21\r\n\r\n<html>captive</html>\n",
    "another_job": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 35\r\n\r\n"
        b'{"id":"job-other","status":"done"}\n'
    ),
    "over_the_size_limit": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2048\r\n\r\n"
    + b" " * 2048,
}

#: ``failed_poll_limit`` in these tests.
LIMIT = 4


class FixedAnswers:
    """A loopback HTTP/1.1 server answering every request with ``raw`` (empty: closing the connection instead);
    ``gets`` counts the requests."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.gets = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                self.gets += 1
                if not self.raw:
                    return
                writer.write(self.raw)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> FixedAnswers:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def submitted(runtime: Runtime, op: str) -> int:
    """``op`` accepted and submitted as remote job ``job-x`` through the ledger; returns its fencing value."""
    ledger = runtime.ledger
    assert await ledger.accept(op, request_text(), submitted_at_ms=0)
    fencing = await ledger.claim_for_submit(op)
    assert fencing is not None and await ledger.save_submitted(op, fencing, "job-x", 0.0, None)
    return fencing


@pytest.fixture
async def provider_at(runtime: Runtime) -> AsyncIterator[list[RemoteClient]]:
    """Point the runtime's remote client at another URL (a 1 KiB answer limit): append the URL's client."""
    clients: list[RemoteClient] = []
    yield clients
    for client in clients:
        await client.aclose()


def use_provider(runtime: Runtime, url: str, clients: list[RemoteClient]) -> None:
    runtime.settings = runtime.settings.replace(
        remote_base_url=url, remote_answer_max_bytes=1024, failed_poll_limit=LIMIT
    )
    client = RemoteClient.from_settings(runtime.settings)
    clients.append(client)
    runtime.remote = client


def schedule_floor_s(runtime: Runtime, poll_count: int) -> float:
    """The shortest delay the backoff gives after ``poll_count`` polls (equal jitter: half the ceiling)."""
    s = runtime.settings
    return float(max(s.poll_min_delay_s, min(s.poll_backoff_cap_s, s.poll_backoff_base_s * 2**poll_count) / 2))


async def next_poll_in_s(pool: asyncpg.Pool, op: str) -> float:
    value = await pool.fetchval(
        "SELECT extract(epoch FROM next_poll_at - now())::float8 FROM operations WHERE operation_id = $1", op
    )
    return float(value)


async def polled_until_stalled(runtime: Runtime, pool: asyncpg.Pool, op: str) -> list[float]:
    """Poll ``op`` LIMIT times (each failing); returns the delay the ledger scheduled after each but the last."""
    delays: list[float] = []
    for i in range(LIMIT):
        assert await poll_now(runtime, pool, op)
        row = await operation(pool, op)
        assert (row["poll_count"], row["failed_poll_count"]) == (i + 1, i + 1)  # each failure counts
        if i + 1 < LIMIT:
            assert row["state"] == "submitted"
            delays.append(await next_poll_in_s(pool, op))
    return delays


@pytest.mark.parametrize("kind", sorted(ANSWERS))
async def test_each_failing_answer_backs_off_and_stalls_after_the_limit(
    runtime: Runtime, pool: asyncpg.Pool, provider_at: list[RemoteClient], kind: str
) -> None:
    op = f"op-failing-{kind}"
    async with FixedAnswers(ANSWERS[kind]) as server:
        use_provider(runtime, server.url, provider_at)
        await submitted(runtime, op)
        delays = await polled_until_stalled(runtime, pool, op)
        assert not await poll_now(runtime, pool, op)  # nothing polls a stalled operation
    # The backoff grew with every failure: after failure i the next GET is at least the schedule's floor away
    # (0.25, 0.5, 1.0 s with the defaults), so GETs per job in any window are bounded by the schedule.
    for i, delay in enumerate(delays):
        assert delay >= schedule_floor_s(runtime, i) - 0.1, (i, delays)
        assert delay <= runtime.settings.poll_backoff_cap_s
    assert server.gets == LIMIT
    row = await operation(pool, op)
    assert (row["state"], row["reason_code"], row["next_poll_at"]) == ("stalled", "poll_failures", None)
    assert row["reason"].startswith(f"{LIMIT} failed polls in a row; remote job job-x, last failure: error=")
    assert "GET job-x" in row["last_observation"]["error"]


async def test_a_get_not_sent_counts_as_a_failed_poll(
    runtime: Runtime, pool: asyncpg.Pool, provider_at: list[RemoteClient]
) -> None:
    use_provider(runtime, f"http://127.0.0.1:{free_closed_port()}", provider_at)
    await submitted(runtime, "op-refused")
    await polled_until_stalled(runtime, pool, "op-refused")
    row = await operation(pool, "op-refused")
    assert (row["state"], row["reason_code"]) == ("stalled", "poll_failures")
    assert "not sent" in row["last_observation"]["error"]


async def test_a_get_cut_off_after_send_counts_as_a_failed_poll_after_the_lease_ttl(
    runtime: Runtime, pool: asyncpg.Pool, provider_at: list[RemoteClient]
) -> None:
    async with FixedAnswers(b"") as server:  # the connection closed after the request: lost after send
        use_provider(runtime, server.url, provider_at)
        await submitted(runtime, "op-cut")
        assert await poll_now(runtime, pool, "op-cut")
    row = await operation(pool, "op-cut")
    assert (row["state"], row["poll_count"], row["failed_poll_count"]) == ("submitted", 1, 1)
    assert await next_poll_in_s(pool, "op-cut") >= runtime.settings.lease_ttl_ms / 1000 - 1.0  # after the lease


async def test_a_usable_answer_ends_a_run_of_failed_polls(runtime: Runtime, pool: asyncpg.Pool) -> None:
    ledger = runtime.ledger
    fencing = await submitted(runtime, "op-reset-failed")
    last = {"error": "GET job-x answered HTTP 503", "http_status": 503}
    assert await ledger.note_poll_setback("op-reset-failed", fencing, ReasonCode.POLL_FAILURES, 3, 0.1, "r", last) == (
        OperationState.SUBMITTED,
        1,
    )
    assert await ledger.note_poll_setback("op-reset-failed", fencing, ReasonCode.POLL_FAILURES, 3, 0.1, "r", last) == (
        OperationState.SUBMITTED,
        2,
    )
    running = JobSnapshot(job_id="job-x", status="running", state=OperationState.RUNNING)
    assert await ledger.save_observation("op-reset-failed", fencing, running, 0.1) is not None
    row = await operation(pool, "op-reset-failed")
    assert (row["failed_poll_count"], row["poll_count"]) == (0, 3)
    assert await ledger.note_poll_setback("op-reset-failed", fencing, ReasonCode.POLL_FAILURES, 3, 0.1, "r", last) == (
        OperationState.RUNNING,
        1,
    )
    assert (
        await ledger.note_poll_setback("op-reset-failed", fencing - 1, ReasonCode.POLL_FAILURES, 3, 0.1, "r", last)
        is None
    )  # fenced


async def test_unknown_statuses_and_failed_polls_count_apart_and_keep_their_own_answer(
    runtime: Runtime, pool: asyncpg.Pool
) -> None:
    """One statement notes both setbacks: each counts its own run (not the other's) and a poll; an unknown status
    is the last observation at once, a failed GET only once it stalls; the limit-th stalls with its reason code."""
    ledger = runtime.ledger
    fencing = await submitted(runtime, "op-setbacks")
    unknown = {"id": "job-x", "status": "paused"}
    failed = {"error": "GET job-x answered HTTP 503", "http_status": 503}
    assert await ledger.note_poll_setback("op-setbacks", fencing, ReasonCode.UNKNOWN_STATUS, 3, 60.0, "u", unknown) == (
        OperationState.SUBMITTED,
        1,
    )
    assert await ledger.note_poll_setback("op-setbacks", fencing, ReasonCode.POLL_FAILURES, 2, 60.0, "f", failed) == (
        OperationState.SUBMITTED,
        1,
    )
    row = await operation(pool, "op-setbacks")
    assert (row["unknown_status_count"], row["failed_poll_count"], row["poll_count"]) == (1, 1, 2)
    assert (row["last_observation"], row["reason"], row["reason_code"]) == (unknown, None, None)
    assert row["last_observed_at"] is not None
    assert 55.0 < await next_poll_in_s(pool, "op-setbacks") <= 60.0
    assert await ledger.note_poll_setback("op-setbacks", fencing, ReasonCode.UNKNOWN_STATUS, 3, 60.0, "u", unknown) == (
        OperationState.SUBMITTED,
        2,
    )
    assert await ledger.note_poll_setback("op-setbacks", fencing, ReasonCode.POLL_FAILURES, 2, 60.0, "f", failed) == (
        OperationState.STALLED,
        2,
    )
    row = await operation(pool, "op-setbacks")
    assert (row["state"], row["reason"], row["reason_code"]) == ("stalled", "f", "poll_failures")
    assert (row["unknown_status_count"], row["failed_poll_count"], row["poll_count"]) == (2, 2, 4)
    assert (row["last_observation"], row["next_poll_at"]) == (failed, None)
    assert (
        await ledger.note_poll_setback("op-setbacks", fencing, ReasonCode.UNKNOWN_STATUS, 3, 60.0, "u", unknown) is None
    )  # not pollable
