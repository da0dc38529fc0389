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

* During a remote call: :meth:`Lease.renewing` renews every third of the TTL and cancels the call when a
  renewal finds the lease lost.
* After a remote call abandoned mid-flight: :meth:`Lease.leave_to_expire` renews the key to a full TTL and
  stops there (no release), so no other worker takes the job while the provider may still serve the call.

Scripts are sent by SHA (``EVALSHA``); redis-py's ``Script`` answers a ``NOSCRIPT`` (script cache flushed,
Redis restarted) by loading the script and running it again, so a lost script cache is never read as "lost"
or "held" (checked against a real Redis, with and without persistence, in ``tests/integration/test_lease.py``).

Pool: a blocking pool of ``max_connections`` (:func:`make_redis`); a command that finds every connection in use
waits up to ``pool_timeout_s`` for one, and a wait that runs out is :class:`~streams.errors.CoordinationBusyError`
(this worker's own load), never :class:`~streams.errors.CoordinationUnavailableError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from streams import metrics
from streams.errors import CoordinationBusyError, CoordinationUnavailableError, LeaseLostError

log = logging.getLogger(__name__)

T = TypeVar("T")

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
#: :data:`REDIS_POOL_EXHAUSTED` is a subclass of ``redis.exceptions.ConnectionError``: catch it first.
REDIS_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    OSError,
    asyncio.TimeoutError,
)

#: No pooled connection free (raised by :class:`WaitingConnectionPool` after its wait): not an outage.
REDIS_POOL_EXHAUSTED = redis.exceptions.MaxConnectionsError


class WaitingConnectionPool(aioredis.BlockingConnectionPool):
    """redis-py's ``BlockingConnectionPool`` (a command waits up to ``timeout`` seconds for a free connection)
    whose wait running out raises ``MaxConnectionsError`` ("pool exhaustion rather than an actual connection
    failure", redis-py's own class) instead of the plain ``ConnectionError("No connection available.")`` that
    cannot be told from Redis being down.

    In redis-py 8.1 that ``ConnectionError`` is raised from the ``asyncio.TimeoutError`` of the wait, and only
    there; connecting a new connection fails with other messages (``tests/integration/test_lease.py`` pins it).
    """

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except redis.exceptions.ConnectionError as exc:
            if isinstance(exc.__cause__, asyncio.TimeoutError) and str(exc) == "No connection available.":
                raise REDIS_POOL_EXHAUSTED(
                    f"no Redis connection of {self.max_connections} came free within {self.timeout} s"
                ) from exc
            raise


def make_redis(
    url: str,
    socket_timeout_s: float,
    *,
    connect_timeout_s: float | None = None,
    max_connections: int = 100,
    pool_timeout_s: float = 5.0,
) -> aioredis.Redis:
    """A redis-py asyncio client with bounded command and connect timeouts (seconds; ``connect_timeout_s``
    defaults to ``socket_timeout_s``) on a :class:`WaitingConnectionPool` of ``max_connections``
    (``Settings.redis_max_connections``) that waits up to ``pool_timeout_s`` for a free one.

    The timeouts make a port that accepts but never answers look like an outage instead of a hang. A command
    whose pooled connection turns out closed (Redis restarted since it was last used: redis-py 8 does not check
    a pooled connection before reuse) is sent once more on a fresh connection; the lease commands are safe to
    repeat (``SET NX`` then finds our own token and reports the lease busy; the scripts compare the token).
    Timeouts are not repeated: a silent Redis is reported as unavailable after one socket timeout.
    """
    pool = WaitingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s if connect_timeout_s is None else connect_timeout_s,
        health_check_interval=5,
        retry=Retry(NoBackoff(), retries=1, supported_errors=(redis.exceptions.ConnectionError,)),
        decode_responses=False,
    )
    return aioredis.Redis.from_pool(pool)


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
        self.left_to_expire = False

    @property
    def ttl_s(self) -> float:
        """The lease TTL in seconds."""
        return self.ttl_ms / 1000.0

    async def renew(self, ttl_ms: int | None = None) -> None:
        """Reset the TTL to ``ttl_ms`` (default: the acquisition TTL) if the key still holds our token.

        Raises:
            LeaseLostError: the key is gone or holds another token (never re-created).
            CoordinationUnavailableError: Redis did not answer.
            CoordinationBusyError: no pooled Redis connection came free in time (nothing sent).
        """
        ttl = self.ttl_ms if ttl_ms is None else ttl_ms
        renewed = await self.manager._run(self.manager._renew, self.key, self.token, ttl)
        if not renewed:
            raise LeaseLostError(self.key)

    async def renewing(self, call: Awaitable[T], every_s: float | None = None) -> T:
        """Await ``call`` (a remote call) while renewing this lease every ``every_s`` seconds (default: a third
        of the TTL), so the lease cannot run out under a call that is still going.

        A renewal that finds the lease lost cancels ``call`` and raises :class:`LeaseLostError` (the call is then
        abandoned: treat it as possibly still in flight). Redis unavailable or busy during the call is logged and
        tried again at the next interval: the call's own deadline, shorter than the TTL by the lease margin,
        ends it before the lease could run out.

        Raises:
            LeaseLostError: a renewal found the key gone or holding another token; ``call`` was cancelled.
            whatever ``call`` raises.
        """
        interval_s = self.ttl_s / 3.0 if every_s is None else every_s
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=interval_s)
                if done:
                    return task.result()
                try:
                    await self.renew()
                except (CoordinationUnavailableError, CoordinationBusyError) as exc:
                    log.warning("lease %s not renewed during a remote call (%s); trying again", self.key, exc)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def keep_until_expiry(self) -> None:
        """Never release this lease (it expires by its TTL); for when there is no time to renew it (cancelled)."""
        self.left_to_expire = True
        self.released = True

    async def leave_to_expire(self) -> float:
        """Stop using this lease without releasing it: renew it to its full TTL (best effort) and let it expire.

        For a remote call abandoned mid-flight: the provider may still be serving it, and the key keeps every
        other worker away from the job until it expires. :meth:`release` becomes a no-op. Returns the seconds
        after which the key is gone at the latest (the TTL); schedule the job's next call no earlier.
        """
        self.keep_until_expiry()
        try:
            await self.renew()
        except (LeaseLostError, CoordinationUnavailableError, CoordinationBusyError) as exc:
            log.warning("lease %s left to expire without renewal (%s)", self.key, exc)
        return self.ttl_s

    async def release(self) -> bool:
        """Delete the key if it still holds our token; True when deleted, False when it was not ours (or the
        lease was :meth:`left to expire <leave_to_expire>`).

        Cancellation-safe: the release runs in a shielded task that completes even if the caller is
        cancelled (the caller still sees ``CancelledError``). Redis being down or busy is logged, not raised:
        the key then simply expires after its TTL.
        """
        if self.released:
            return False
        self.released = True
        task = asyncio.ensure_future(self._release_now())
        return await asyncio.shield(task)

    async def _release_now(self) -> bool:
        try:
            deleted = await self.manager._run(self.manager._release, self.key, self.token)
        except (CoordinationUnavailableError, CoordinationBusyError) as exc:
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
        except REDIS_POOL_EXHAUSTED as exc:
            metrics.REDIS_POOL_BUSY.labels("script").inc()
            raise CoordinationBusyError(f"Redis busy for lease {key!r}: {exc}") from exc
        except REDIS_UNAVAILABLE as exc:
            raise CoordinationUnavailableError(f"Redis unavailable for lease {key!r}: {exc}") from exc
        return int(result)

    async def acquire(self, key: str, ttl_ms: int | None = None) -> Lease | None:
        """Try once to take the lease ``key``; None when it is busy (normal, do not spin): another owner holds
        it, or no connection of this worker's Redis pool came free in time (counted in
        ``streams_redis_pool_busy_total``; this worker's own load, never an outage). Try again later either way.

        Raises:
            CoordinationUnavailableError: Redis did not answer; make no claim and no remote call.
        """
        ttl = self.ttl_ms if ttl_ms is None else ttl_ms
        token = secrets.token_hex(16)
        try:
            ok = await self.client.set(key, token, nx=True, px=ttl)
        except REDIS_POOL_EXHAUSTED as exc:
            metrics.REDIS_POOL_BUSY.labels("acquire").inc()
            log.info("lease %s not tried: %s", key, exc)
            return None
        except REDIS_UNAVAILABLE as exc:
            raise CoordinationUnavailableError(f"Redis unavailable acquiring lease {key!r}: {exc}") from exc
        return Lease(self, key, token, ttl) if ok else None

    async def healthy(self) -> bool:
        """True when Redis answers PING within the client's socket timeout. A pool with no free connection
        counts as healthy (the worker is busy; Redis is not down)."""
        try:
            return bool(await self.client.ping())
        except REDIS_POOL_EXHAUSTED:
            metrics.REDIS_POOL_BUSY.labels("ping").inc()
            return True
        except REDIS_UNAVAILABLE:
            return False
