"""Short Redis leases that coordinate workers (seed: "Redis generation job lease").

A lease only reduces duplicate work; it is never proof of anything. Durable truth and the fencing value
live in PostgreSQL (:mod:`streams.ledger`).

* Acquire: ``SET <key> <fresh random owner token> NX PX <ttl_ms>``; not getting it is normal (returns None).
* Renew: Lua compare-and-``PEXPIRE``; a missing key is never re-created; a mismatch raises
  :class:`~streams.errors.LeaseLostError`.
* Release: Lua compare-and-``DEL``; deleting unconditionally could remove a newer worker's lease.

Each :class:`Lease` holds its own owner token (unlike redis-py's ``Lock``, whose token is shared through the
lock object across tasks), and release is shielded from cancellation: if the caller is cancelled mid-release,
the script still runs to completion in the background, and in any case the key keeps its PX expiry, so
no key is ever left without one.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from streams.errors import CoordinationUnavailableError, LeaseLostError

log = logging.getLogger(__name__)

#: KEYS[1] lease key; ARGV[1] owner token. Returns 1 when deleted, 0 when the key is absent or not ours.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

#: KEYS[1] lease key; ARGV[1] owner token; ARGV[2] new TTL in ms. Returns 1 when the TTL was reset,
#: 0 when the key is absent or holds another token (the key is never created here).
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

#: Errors that mean "Redis did not answer": no claim may be made and no remote call without a lease.
REDIS_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    OSError,
    asyncio.TimeoutError,
)


def make_redis(url: str, socket_timeout_s: float) -> aioredis.Redis:
    """A redis-py asyncio client with bounded connect/read timeouts (seconds).

    The timeouts make a port that accepts but never answers look like an outage instead of a hang.
    """
    client: aioredis.Redis = aioredis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        health_check_interval=5,
        retry_on_timeout=False,
        decode_responses=False,
    )
    return client


class Lease:
    """One acquired lease: its key, its own owner token and TTL.

    Use :meth:`renew` before acting on the lease after a long wait and :meth:`release` when done.
    """

    def __init__(self, manager: LeaseManager, key: str, token: str, ttl_ms: int) -> None:
        self.manager = manager
        self.key = key
        self.token = token
        self.ttl_ms = ttl_ms
        self.acquired_monotonic = time.monotonic()
        self.released = False

    async def renew(self, ttl_ms: int | None = None) -> None:
        """Reset the TTL to ``ttl_ms`` (default: the acquisition TTL) if the key still holds our token.

        Raises:
            LeaseLostError: the key is gone or holds another token (never re-created).
            CoordinationUnavailableError: Redis did not answer.
        """
        ttl = self.ttl_ms if ttl_ms is None else ttl_ms
        renewed = await self.manager._run(self.manager._renew, self.key, self.token, ttl)
        if not renewed:
            raise LeaseLostError(self.key)

    async def release(self) -> bool:
        """Delete the key if it still holds our token; True when deleted, False when it was not ours.

        Cancellation-safe: the release runs in a shielded task that completes even if the caller is
        cancelled (the caller still sees ``CancelledError``). Redis being down is logged, not raised: the
        key then simply expires after its TTL.
        """
        if self.released:
            return False
        self.released = True
        task = asyncio.ensure_future(self._release_now())
        return await asyncio.shield(task)

    async def _release_now(self) -> bool:
        try:
            deleted = await self.manager._run(self.manager._release, self.key, self.token)
        except CoordinationUnavailableError as exc:
            log.warning("lease %s not released (%s); it expires by its TTL", self.key, exc)
            return False
        return bool(deleted)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


class LeaseManager:
    """Acquires leases on one Redis client with one TTL (milliseconds).

    Args:
        client: a redis-py asyncio client (see :func:`make_redis`).
        ttl_ms: lease time-to-live in milliseconds (seed example: 45000).
    """

    def __init__(self, client: aioredis.Redis, ttl_ms: int) -> None:
        self.client = client
        self.ttl_ms = ttl_ms
        self._release = client.register_script(RELEASE_LUA)
        self._renew = client.register_script(RENEW_LUA)

    async def _run(self, script: Any, key: str, *args: Any) -> int:
        try:
            result = await script(keys=[key], args=list(args))
        except REDIS_UNAVAILABLE as exc:
            raise CoordinationUnavailableError(f"Redis unavailable for lease {key!r}: {exc}") from exc
        return int(result)

    async def acquire(self, key: str, ttl_ms: int | None = None) -> Lease | None:
        """Try once to take the lease ``key``; None when another owner holds it (normal, do not spin).

        Raises:
            CoordinationUnavailableError: Redis did not answer; make no claim and no remote call.
        """
        ttl = self.ttl_ms if ttl_ms is None else ttl_ms
        token = secrets.token_hex(16)
        try:
            ok = await self.client.set(key, token, nx=True, px=ttl)
        except REDIS_UNAVAILABLE as exc:
            raise CoordinationUnavailableError(f"Redis unavailable acquiring lease {key!r}: {exc}") from exc
        return Lease(self, key, token, ttl) if ok else None

    async def healthy(self) -> bool:
        """True when Redis answers PING within the client's socket timeout."""
        try:
            return bool(await self.client.ping())
        except REDIS_UNAVAILABLE:
            return False
