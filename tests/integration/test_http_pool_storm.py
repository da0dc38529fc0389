"""The remote client's connection pool through a storm of slow answers, resets and cancellations.

For 5 s the provider (a real socket server, :class:`tests.http_faults.FlakyProvider`) accepts connections but
answers only after 10 s and resets 20% of them, while 30% of the GETs in flight are cancelled by their callers;
then it recovers. The product's :class:`~streams.remote.client.RemoteClient` must come out with a working pool: no
GET waiting for a connection in vain, at least 99% of GETs succeeding, and POSTs still classified by whether a
byte was sent (checked against what the server actually received).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest

from streams import metrics
from streams.config import Settings
from streams.errors import RemoteAbandonedError, RemoteNotSentError, RemoteTransientError, RemoteUnknownOutcomeError
from streams.remote.client import RemoteClient
from tests.http_faults import FlakyProvider
from tests.support import wait_for

pytestmark = pytest.mark.integration

#: A provider request (JSON text) as a submission carries it.
REQUEST = '{"input": {"prompt": "a short prompt", "max_tokens": 1}}'

STORM_S = 5.0
CANCEL_RATE = 0.3
RECOVERY_GETS_PER_CALLER = 25  # 500 GETs after the storm, 20 callers at once


@pytest.fixture
async def provider() -> AsyncIterator[FlakyProvider]:
    p = FlakyProvider(slow_s=10.0, reset_rate=0.2)
    await p.start()
    yield p
    await p.stop()


#: Storms of cancelled calls (:func:`cancelled_calls`) run at most, one after another, until httpcore needed a pool
#: repair: whether a cancellation lands in the phase that loses a slot depends on the machine's timing (one storm
#: was enough in most runs, not in all).
STORMS_FOR_A_REPAIR = 5


async def cancelled_calls(client: RemoteClient, provider: FlakyProvider, rng: random.Random) -> None:
    """150 rounds of 8 GETs answered after 20 ms, each cancelled at a random moment within 50 ms."""
    provider.storm = True  # every answer after 20 ms
    for _ in range(150):
        calls = [asyncio.create_task(client.observe("op-churn", f"job-{i}")) for i in range(8)]
        for call in calls:
            asyncio.get_running_loop().call_later(rng.uniform(0.0, 0.05), call.cancel)
        await asyncio.gather(*calls, return_exceptions=True)
    provider.storm = False


async def get_outcome(client: RemoteClient, i: int, cancel_rate: float, rng: random.Random) -> str:
    """One GET: ``ok``, ``cancelled`` (by its caller), ``abandoned`` (sent, cut off) or ``not_sent`` (no pooled
    connection within the deadline: what a leaking pool would produce)."""
    task = asyncio.create_task(client.observe(f"op-{i}", f"job-{i}"))
    if rng.random() < cancel_rate:
        asyncio.get_running_loop().call_later(rng.uniform(0.0, 1.0), task.cancel)
    try:
        await task
        return "ok"
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        return "cancelled"
    except RemoteAbandonedError:
        return "abandoned"
    except RemoteTransientError as exc:
        assert "not sent" in str(exc), exc
        return "not_sent"


async def post_outcome(client: RemoteClient, op: str) -> str:
    try:
        await client.submit(op, REQUEST)
        return "created"
    except RemoteNotSentError:
        return "not_sent"
    except RemoteUnknownOutcomeError:
        return "unknown"


def assert_no_connection_held(client: RemoteClient, transport: str, slots: int) -> None:
    """Every pooled connection idle or closed once the callers are done, whichever transport."""
    if transport == "httpx":
        pool = client.http._transport._pool  # type: ignore[attr-defined]  # httpcore's AsyncConnectionPool
        assert pool._requests == []
        assert len(pool.connections) <= slots
        assert [c for c in pool.connections if not (c.is_idle() or c.is_closed())] == []
    else:
        connector = client.http._transport._session.connector  # type: ignore[attr-defined]  # aiohttp's
        assert len(connector._acquired) == 0  # connections handed out and never given back


@pytest.fixture(params=["aiohttp", "httpx"])
def transport(request: pytest.FixtureRequest) -> str:
    """The HTTP transport under the remote client (``STREAMS_HTTP_TRANSPORT``)."""
    return str(request.param)


async def test_pool_recovers_after_slow_answers_resets_and_cancellations(
    settings: Settings, provider: FlakyProvider, transport: str
) -> None:
    settings = settings.replace(
        http_transport=transport,
        remote_base_url=provider.url,
        dispatcher_concurrency=4,
        observer_concurrency=16,
        # a deadline with room for a CPU-starved test machine (the 10 s answers still outlast it)
        lease_ttl_ms=10_000,
        visibility_timeout_s=10.0,
        remote_call_deadline_s=4.0,
        lease_margin_s=2.0,
    )
    slots = settings.http_max_connections  # 20 connections, one per agent slot; as many callers
    client = RemoteClient.from_settings(settings)
    rng = random.Random(7)
    storm: Counter[str] = Counter()
    storm_posts: dict[str, str] = {}
    counter = iter(range(1_000_000))

    async def get_loop(until: float, cancel_rate: float, into: Counter[str]) -> None:
        while time.monotonic() < until:
            into[await get_outcome(client, next(counter), cancel_rate, rng)] += 1

    async def post_loop(until: float) -> None:
        while time.monotonic() < until:
            op = f"storm-post-{next(counter)}"
            storm_posts[op] = await post_outcome(client, op)
            await asyncio.sleep(0.05)

    try:
        provider.storm = True
        until = time.monotonic() + STORM_S
        await asyncio.gather(*(get_loop(until, CANCEL_RATE, storm) for _ in range(slots)), post_loop(until))
        provider.storm = False  # recovered; the loops above waited for their last GETs (deadline-bounded)

        recovered: Counter[str] = Counter()

        async def recovery_loop() -> None:
            for _ in range(RECOVERY_GETS_PER_CALLER):
                recovered[await get_outcome(client, next(counter), 0.0, rng)] += 1

        await asyncio.gather(*(recovery_loop() for _ in range(slots)))

        post_counts = Counter(storm_posts.values())
        print(
            f"storm GETs {dict(storm)}; server {dict(provider.served)}; storm POSTs {dict(post_counts)}; "
            f"after recovery {dict(recovered)}"
        )
        assert storm["cancelled"] > 0 and storm["abandoned"] > 0 and provider.served["reset"] > 0
        total = sum(recovered.values())
        assert total == slots * RECOVERY_GETS_PER_CALLER
        assert recovered["not_sent"] == 0, f"GETs found no pooled connection after the storm: {recovered}"
        assert recovered["ok"] / total >= 0.99, recovered
        # and nothing is left held in the pool: every connection idle (or closed) once the callers are done
        assert_no_connection_held(client, transport, slots)
        # "not sent" is only ever said of a POST the server never received
        assert not {op for op, o in storm_posts.items() if o == "not_sent"} & provider.posts_seen

        # POST taxonomy on the same client after the storm
        assert await post_outcome(client, "after-created") == "created"
        provider.storm, provider.reset_rate = True, 0.0  # sent, then no answer within the deadline
        assert await post_outcome(client, "after-slow") == "unknown" and "after-slow" in provider.posts_seen
        provider.reset_rate = 1.0  # sent, then the connection is reset
        assert await post_outcome(client, "after-reset") == "unknown" and "after-reset" in provider.posts_seen
        provider.reset_rate = 0.0
        gets_before = provider.received["GET"]
        holders = [  # no read timeout: they hold their connections until cancelled
            asyncio.create_task(client.http.get(f"/v1/generations/hold-{i}", timeout=60)) for i in range(slots)
        ]
        try:

            async def pool_full() -> bool:
                return provider.received["GET"] == gets_before + slots

            await wait_for(pool_full, 5, "GETs holding every pooled connection")
            assert await post_outcome(client, "after-pool-full") == "not_sent"
            assert "after-pool-full" not in provider.posts_seen
        finally:
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
    finally:
        provider.storm = False
        await client.aclose()


async def test_calls_cancelled_under_contention_leave_no_pool_slot_behind(settings: Settings, transport: str) -> None:
    """Two pooled connections, eight callers at a time, each cancelled within 50 ms while answers take 20 ms:
    cancellations land in every phase of a call (waiting for a slot, connecting, sending, reading). httpcore
    1.0.9 alone lost both slots within ~20 rounds (connections stuck "connecting"/"NEW", requests listed as
    active), after which every call failed with PoolTimeout against a healthy server; aiohttp's connector gives
    every connection back by itself."""
    provider = FlakyProvider(slow_s=0.02, reset_rate=0.0)
    await provider.start()
    settings = settings.replace(
        http_transport=transport,
        remote_base_url=provider.url,
        dispatcher_concurrency=1,
        observer_concurrency=1,
        http_pool_timeout_s=0.5,
    )
    client = RemoteClient.from_settings(settings)
    rng = random.Random(3)
    repairs = metrics.HTTP_POOL_REPAIRS._value.get()
    try:
        for _ in range(STORMS_FOR_A_REPAIR):  # httpcore: until a cancellation landed where it loses a slot
            await cancelled_calls(client, provider, rng)
            if transport != "httpx" or metrics.HTTP_POOL_REPAIRS._value.get() > repairs:
                break
        assert_no_connection_held(client, transport, settings.http_max_connections)
        outcomes = Counter([await get_outcome(client, i, 0.0, rng) for i in range(20)])
        assert outcomes == Counter(ok=20)
        if transport == "httpx":  # the repair is httpcore's alone
            assert metrics.HTTP_POOL_REPAIRS._value.get() > repairs
    finally:
        await client.aclose()
        await provider.stop()


async def test_through_a_proxy_from_the_environment_cancelled_calls_leave_no_pool_slot_behind(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``STREAMS_HTTP_TRANSPORT=httpx``, ``HTTP_PROXY`` in the worker's environment routes the remote client's
    requests to httpx's proxy transport (another httpcore pool than the client's own): the pool repair must cover
    that pool too, or the same cancellations as above exhaust it."""
    provider = FlakyProvider(slow_s=0.02, reset_rate=0.0)  # serves absolute-form requests too: a proxy to itself
    await provider.start()
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", provider.url)
    settings = settings.replace(
        http_transport="httpx",
        remote_base_url="http://generation-api.invalid",  # reached only through the proxy
        remote_allow_plain_http=True,  # a test host behind the test proxy
        dispatcher_concurrency=1,
        observer_concurrency=1,
        http_pool_timeout_s=0.5,
    )
    client = RemoteClient.from_settings(settings)
    rng = random.Random(3)
    try:
        assert client.http._transport_for_url(httpx.URL(settings.remote_base_url.get_secret_value())) is not (
            client.http._transport
        )  # routed to the proxy's transport
        await cancelled_calls(client, provider, rng)
        outcomes = Counter([await get_outcome(client, i, 0.0, rng) for i in range(20)])
        assert outcomes == Counter(ok=20)
    finally:
        await client.aclose()
        await provider.stop()
