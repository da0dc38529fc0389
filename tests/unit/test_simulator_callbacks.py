"""The simulator's completion callbacks over real loopback HTTP (streams_harness.simulator.callbacks): signed as
Standard Webhooks, duplicated with the same webhook-id, badly signed, lost, retried on a non-2xx answer."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from streams.config import callback_secret_key
from streams.errors import CallbackRefusedError
from streams.remote.callbacks import job_id_of, verify
from streams_harness.simulator import SimulatorConfig, make_app

SECRET = "whsec_" + base64.b64encode(b"simulator callback secret").decode()
AUTH = {"Authorization": "Bearer test-token"}
BODY = {"model": "sim-model", "input": {"prompt": "a short prompt", "max_tokens": 2}}


class Receiver:
    """A callback receiver recording what arrived, answering ``status`` the first ``refuse_first`` times; while
    ``hold`` is set it keeps each request unanswered until the event is set (``holding`` is set once one waits)."""

    def __init__(self) -> None:
        self.arrived: list[tuple[str, str]] = []  # (webhook-id, "ok" | the refusal's reason)
        self.refuse_first = 0
        self.hold: asyncio.Event | None = None
        self.holding = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if self.hold is not None:
            self.holding.set()
            await self.hold.wait()
        try:
            webhook_id = verify(
                request.headers, body, [callback_secret_key(SECRET)], tolerance_s=300, now_s=time.time()
            )
            job_id_of(body)
        except CallbackRefusedError as exc:
            self.arrived.append((request.headers.get("webhook-id", ""), exc.reason.value))
            return web.Response(status=exc.status)
        self.arrived.append((webhook_id, "ok"))
        if self.refuse_first > 0:
            self.refuse_first -= 1
            return web.Response(status=404)
        return web.Response(status=204)


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    r = Receiver()
    app = web.Application()
    app.router.add_post("/cb", r.handle)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    yield r, str(server.make_url("/cb"))
    await server.close()


async def run_job(url: str, **faults: Any) -> dict[str, Any]:
    """One job through a simulator sending callbacks to ``url`` with ``faults``; its summary's ``callbacks``."""
    config = SimulatorConfig(
        compression=1000.0, get_latency_ms=1.0, seed=3, callback_url=url, callback_secret=SECRET, **faults
    )
    server = TestServer(make_app(config), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url("")).rstrip("/"), timeout=5.0) as client:
            assert (await client.post("/v1/generations", content=orjson.dumps(BODY), headers=AUTH)).status_code == 201
            for _ in range(200):  # until every planned delivery ended (acknowledged, refused to the end, or lost)
                summary: dict[str, Any] = (await client.get("/_sim/summary")).json()["callbacks"]
                if summary["lost"] or summary["acknowledged"] + summary["bad_signature"] >= 1 + summary["duplicated"]:
                    if not summary["bad_signature"] or summary["attempts"] >= faults.get("callback_attempts", 3):
                        break
                await asyncio.sleep(0.05)
            config_shown = (await client.get("/_sim/summary")).json()
            assert SECRET not in orjson.dumps(config_shown).decode()
            return summary
    finally:
        await server.close()


async def test_a_signed_callback_per_finished_job(receiver: tuple[Receiver, str]) -> None:
    r, url = receiver
    summary = await run_job(url)
    assert [reason for _, reason in r.arrived] == ["ok"]
    assert r.arrived[0][0].startswith("msg_")
    assert (summary["scheduled"], summary["acknowledged"], summary["statuses"]) == (1, 1, {"204": 1})


async def test_duplicates_carry_the_same_webhook_id(receiver: tuple[Receiver, str]) -> None:
    r, url = receiver
    summary = await run_job(url, callback_duplicates=1.0)
    assert len(r.arrived) == 2 and r.arrived[0] == r.arrived[1]
    assert (summary["duplicated"], summary["acknowledged"]) == (1, 2)


async def test_bad_signatures_are_refused_and_retried_up_to_the_attempts(receiver: tuple[Receiver, str]) -> None:
    r, url = receiver
    summary = await run_job(url, callback_bad_signature=1.0, callback_attempts=2)
    assert [reason for _, reason in r.arrived] == ["bad_signature", "bad_signature"]
    assert (summary["attempts"], summary["refused"], summary["statuses"]) == (2, 2, {"401": 2})


async def test_an_attempt_is_counted_when_it_ends_with_its_outcome(receiver: tuple[Receiver, str]) -> None:
    """A summary read while an attempt waits for its answer does not count it yet, so a reader waiting for
    ``attempts`` to reach a number finds every outcome of those attempts counted too."""
    r, url = receiver
    r.hold = asyncio.Event()
    config = SimulatorConfig(compression=1000.0, get_latency_ms=1.0, seed=3, callback_url=url, callback_secret=SECRET)
    server = TestServer(make_app(config), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url("")).rstrip("/"), timeout=5.0) as client:
            assert (await client.post("/v1/generations", content=orjson.dumps(BODY), headers=AUTH)).status_code == 201
            await asyncio.wait_for(r.holding.wait(), 10)
            held = (await client.get("/_sim/summary")).json()["callbacks"]
            assert (held["attempts"], held["acknowledged"], held["statuses"]) == (0, 0, {})
            r.hold.set()
            for _ in range(200):
                ended = (await client.get("/_sim/summary")).json()["callbacks"]
                if ended["attempts"]:
                    break
                await asyncio.sleep(0.05)
            assert (ended["attempts"], ended["acknowledged"], ended["statuses"]) == (1, 1, {"204": 1})
    finally:
        await server.close()


async def test_a_non_2xx_answer_is_retried_with_the_same_id(receiver: tuple[Receiver, str]) -> None:
    r, url = receiver
    r.refuse_first = 1
    summary = await run_job(url)
    assert len(r.arrived) == 2 and r.arrived[0] == r.arrived[1]
    assert summary["statuses"] == {"404": 1, "204": 1}


async def test_a_lost_callback_is_never_sent(receiver: tuple[Receiver, str]) -> None:
    r, url = receiver
    summary = await run_job(url, callback_loss=1.0)
    assert (summary["lost"], summary["attempts"], r.arrived) == (1, 0, [])


def test_a_callback_url_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="callback_secret"):
        SimulatorConfig(callback_url="http://127.0.0.1:1/cb")
    assert (
        SimulatorConfig(callback_url="http://127.0.0.1:1/cb", callback_secret=SECRET).to_dict()["callback_secret"]
        == "**********"
    )
