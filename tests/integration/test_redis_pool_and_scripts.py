"""The lease client against real Redis servers: its pool under a burst, and a lost script cache.

Restarts use a PRIVATE ``redis-server`` started by the test on a free port (with and without persistence);
the shared Redis on 6379 is only used for the pool burst, under the test's own key prefix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from streams import metrics
from streams.config import Settings
from streams.coordination.lease import Lease, LeaseManager, make_redis
from streams.errors import CoordinationBusyError, CoordinationUnavailableError, LeaseLostError
from streams_harness.redis_server import PrivateRedis
from tests.support import wait_for

pytestmark = pytest.mark.integration


# --- the pool: waiting is not an outage ----------------------------------------------------------------------


async def test_thousand_concurrent_acquisitions_all_complete_without_an_outage(settings: Settings) -> None:
    """1,000 acquisitions at once through the worker's own Redis client (pool sized from the agents'
    concurrency): each one takes its lease or finds it busy; none is reported as Redis being unavailable."""
    client = make_redis(
        settings.redis_url.get_secret_value(),
        settings.redis_socket_timeout_s,
        connect_timeout_s=settings.redis_connect_timeout_s,
        max_connections=settings.redis_max_connections,
        pool_timeout_s=settings.redis_pool_timeout_s,
    )
    manager = LeaseManager(client, 10_000)
    keys = [f"{settings.lease_key_prefix}:burst:{i % 500}" for i in range(1000)]  # each key wanted twice
    try:
        started = time.monotonic()
        results = await asyncio.gather(*(manager.acquire(k) for k in keys), return_exceptions=True)
        elapsed = time.monotonic() - started
        errors = [r for r in results if isinstance(r, BaseException)]
        leases = [r for r in results if isinstance(r, Lease)]
        assert errors == [], f"{len(errors)} of 1000 failed, first: {errors[:1]}"
        assert len(leases) == 500 and results.count(None) == 500
        assert {lease.key for lease in leases} == set(keys)
        print(f"1000 concurrent acquisitions: 500 taken, 500 busy, 0 outages in {elapsed:.3f} s")
        released = await asyncio.gather(*(lease.release() for lease in leases))
        assert all(released)
    finally:
        await client.aclose()


async def test_a_pool_wait_that_runs_out_is_busy_not_an_outage(settings: Settings) -> None:
    """One pooled connection, held by a blocking command: a lease command waits ``pool_timeout_s`` for it and
    is then "busy" (acquire -> None, renew -> CoordinationBusyError), never CoordinationUnavailableError; the
    health check still says Redis is up. Pins redis-py's BlockingConnectionPool behaviour this relies on."""
    client = make_redis(settings.redis_url.get_secret_value(), 5.0, max_connections=1, pool_timeout_s=0.3)
    manager = LeaseManager(client, 10_000)
    key = f"{settings.lease_key_prefix}:pool-busy"
    lease = await manager.acquire(key)
    assert lease is not None
    busy = metrics.REDIS_POOL_BUSY.labels("acquire")._value.get()
    holder = asyncio.ensure_future(client.blpop([f"{settings.lease_key_prefix}:never"], timeout=1.5))
    try:

        async def held() -> bool:
            return not client.connection_pool.can_get_connection()

        await wait_for(held, 5, "the BLPOP to hold the only pooled connection")
        started = time.monotonic()
        assert await manager.acquire(f"{key}:other") is None
        assert 0.25 < time.monotonic() - started < 1.0
        assert metrics.REDIS_POOL_BUSY.labels("acquire")._value.get() == busy + 1
        with pytest.raises(CoordinationBusyError):
            await lease.renew()
        assert await manager.healthy() is True
    finally:
        assert await holder is None
    assert await manager.acquire(f"{key}:other") is not None  # the connection is back: works again
    await lease.renew()
    assert await lease.release() is True
    await client.delete(f"{key}:other")
    await client.aclose()


# --- the script cache: NOSCRIPT is reloaded, never read as "lost" or "held" ------------------------------------


@pytest.fixture(params=[False, True], ids=["no-persistence", "aof-persistence"])
async def private_redis(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[PrivateRedis]:
    server = PrivateRedis(tmp_path, persistent=request.param)
    await server.start()
    yield server
    server.stop()


@pytest.fixture
def private_manager(private_redis: PrivateRedis) -> Iterator[LeaseManager]:
    client = make_redis(private_redis.url, 1.0, max_connections=8, pool_timeout_s=1.0)
    yield LeaseManager(client, 10_000)


async def test_script_flush_between_acquisition_renewal_and_release(
    private_redis: PrivateRedis, private_manager: LeaseManager
) -> None:
    client = private_manager.client
    lease = await private_manager.acquire("lease:flush")
    assert lease is not None
    await lease.renew()  # the renewal script is now cached by Redis
    await client.script_flush()
    await client.pexpire("lease:flush", 3000)
    await lease.renew()  # NOSCRIPT -> loaded again, ran: the TTL is back to 10 s
    assert await client.pttl("lease:flush") > 9000
    await client.script_flush()
    other = await private_manager.acquire("lease:flush-other")
    assert other is not None
    await client.set("lease:flush-other", "someone-else", px=5000)
    await client.script_flush()
    with pytest.raises(LeaseLostError):  # a real mismatch after a flush is still "lost", not an error
        await other.renew()
    await client.script_flush()
    assert await lease.release() is True
    assert await client.exists("lease:flush") == 0  # deleted at once, not left to its TTL
    await private_manager.client.aclose()


async def test_restart_between_acquisition_and_renewal_and_release(
    private_redis: PrivateRedis, private_manager: LeaseManager
) -> None:
    """Restarted without persistence the key is gone: renewal says "lost" (truthfully) and the lease can be
    taken again. With AOF persistence the key survives with its expiry: renewal and release work at once
    (the restarted Redis has no scripts cached)."""
    client = private_manager.client
    lease = await private_manager.acquire("lease:restart")
    assert lease is not None
    await lease.renew()
    await private_redis.restart()
    fresh = aioredis.Redis.from_url(private_redis.url)
    assert await fresh.script_exists(private_manager._renew.sha) == [False]  # the restarted Redis has no scripts
    await fresh.aclose()
    # the lease's next command is the first on its pooled connection since the restart
    if private_redis.persistent:
        await lease.renew()
        assert await client.get("lease:restart") == lease.token.encode()
        assert await client.pttl("lease:restart") > 9000
        assert await lease.release() is True
        assert await client.exists("lease:restart") == 0
    else:
        with pytest.raises(LeaseLostError):
            await lease.renew()
        assert await client.exists("lease:restart") == 0  # gone with the restart; renewal never re-creates it
        again = await private_manager.acquire("lease:restart")
        assert again is not None
        await private_redis.restart()  # and once more between this acquisition and its release
        assert await again.release() is False  # gone with the restart: nothing of ours to delete
        third = await private_manager.acquire("lease:restart")
        assert third is not None and await third.release() is True
        assert await client.exists("lease:restart") == 0
    await client.aclose()


async def test_redis_down_is_unavailable_not_lost(private_redis: PrivateRedis, private_manager: LeaseManager) -> None:
    lease = await private_manager.acquire("lease:down")
    assert lease is not None
    private_redis.stop()
    with pytest.raises(CoordinationUnavailableError):
        await lease.renew()
    assert await lease.release() is False  # logged; the key expires by its TTL
    await private_redis.start()
    await private_manager.client.aclose()
