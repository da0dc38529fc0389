"""Redis leases against a real Redis: exclusive acquisition, renewal and release by the owner token only (a
newer holder is never touched), cancellation, outages."""

from __future__ import annotations

import asyncio
import functools

import pytest

from streams.coordination.lease import LeaseManager, make_redis
from streams.errors import CoordinationUnavailableError, LeaseLostError
from tests.support import wait_for

pytestmark = pytest.mark.integration


async def gone(leases: LeaseManager, key: str) -> bool:
    """True once ``key`` no longer exists in Redis (released, or expired by its TTL)."""
    return await leases.client.exists(key) == 0


async def test_acquire_is_exclusive_with_fresh_tokens(leases: LeaseManager) -> None:
    a = await leases.acquire("lease-test:x")
    assert a is not None
    assert await leases.acquire("lease-test:x") is None
    assert await a.release() is True
    b = await leases.acquire("lease-test:x")
    assert b is not None and b.token != a.token
    await b.release()


async def test_acquire_sets_px_expiry(leases: LeaseManager) -> None:
    lease = await leases.acquire("lease-test:ttl", ttl_ms=5000)
    assert lease is not None
    pttl = await leases.client.pttl("lease-test:ttl")
    assert 4000 < pttl <= 5000
    await lease.release()


async def test_renewal_after_ownership_change_fails_and_never_recreates(leases: LeaseManager) -> None:
    key = "lease-test:renew"
    old = await leases.acquire(key, ttl_ms=100)
    assert old is not None
    await wait_for(lambda: gone(leases, key), 5, "the TTL to run out in Redis (real expiry is the point)")
    with pytest.raises(LeaseLostError):
        await old.renew()
    assert await leases.client.exists(key) == 0  # renewal never re-creates a missing key
    new = await leases.acquire(key, ttl_ms=10_000)
    assert new is not None
    with pytest.raises(LeaseLostError):
        await old.renew()
    assert await leases.client.get(key) == new.token.encode()
    await new.release()


async def test_delayed_release_with_old_token_keeps_newer_holder(leases: LeaseManager) -> None:
    key = "lease-test:release"
    old = await leases.acquire(key, ttl_ms=100)
    assert old is not None
    await wait_for(lambda: gone(leases, key), 5, "the old lease to expire in Redis")
    new = await leases.acquire(key, ttl_ms=30_000)
    assert new is not None
    ttl_before = await leases.client.pttl(key)
    assert await old.release() is False
    assert await leases.client.get(key) == new.token.encode()
    ttl_after = await leases.client.pttl(key)
    assert ttl_after > ttl_before - 1000  # not shortened (allowing for elapsed time)
    assert await leases.client.set(key, "third", nx=True, px=1000) is None
    await new.release()


async def test_cancelled_release_completes_or_leaves_expiry(leases: LeaseManager) -> None:
    for i in range(20):
        key = f"lease-test:cancel:{i}"
        lease = await leases.acquire(key, ttl_ms=2000)
        assert lease is not None
        task = asyncio.create_task(lease.release())
        await asyncio.sleep(0)  # one turn of the loop: the release starts, then is cancelled mid-way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the shielded release finishes in the background; in every case the key has an expiry or is gone
        pttl = await leases.client.pttl(key)
        assert pttl == -2 or pttl > 0
        await wait_for(functools.partial(gone, leases, key), 5, f"{key} released or expired")
        assert await leases.acquire(key) is not None


async def test_redis_unreachable_raises_coordination_unavailable() -> None:
    client = make_redis("redis://127.0.0.1:1/0", 0.5)
    manager = LeaseManager(client, 1000)
    with pytest.raises(CoordinationUnavailableError):
        await manager.acquire("lease-test:down")
    assert await manager.healthy() is False
    await client.aclose()


async def test_redis_accepting_but_silent_times_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.Event().wait()  # never answers

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = make_redis(f"redis://127.0.0.1:{port}/0", 0.3)
    manager = LeaseManager(client, 1000)
    started = asyncio.get_running_loop().time()
    with pytest.raises(CoordinationUnavailableError):
        await manager.acquire("lease-test:silent")
    assert asyncio.get_running_loop().time() - started < 3.0
    await client.aclose()
    server.close()
