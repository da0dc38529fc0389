"""Short Redis leases that coordinate workers (seed: "Redis generation job lease").

A lease only reduces duplicate work; it is never proof of anything. Durable truth and the fencing value
live in PostgreSQL (:mod:`streams.ledger.store`).

* Acquire: ``SET <key> <fresh random owner token> NX PX <ttl_ms> GET``; not getting it is normal (returns None).
  ``GET`` answers the token the key held: our own when the command ran twice (its reply lost, sent again), so a
  repeated acquisition is still ours. An acquisition whose caller is cancelled before it answers releases the key
  if it took it (its owner token is known to no one else).
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

Every command goes through the worker's one coalescing Redis stage
(:class:`~streams.coordination.redisstage.RedisStage`):
the lease commands (and rate budget slots) of all its tasks at a Redis step at once share one pipelined round
trip, each with its own reply. Scripts are sent by SHA (``EVALSHA``); a ``NOSCRIPT`` (script cache flushed,
Redis restarted) is answered by sending that command again with the script's text, so a lost script cache is
never read as "lost" or "held" (checked against a real Redis, with and without persistence, in
``tests/integration/test_redis_pool_and_scripts.py`` and ``tests/integration/test_redis_stage.py``).

Renewals that confirm nothing are skipped (:meth:`Lease.renew_if_due`, before a remote call or a claim). The
rule: an acquisition or renewal submitted at ``time.monotonic()`` ``t`` with TTL ``ttl`` leaves the key ours
until ``t + ttl`` at the earliest (Redis starts the PX expiry when it runs the command, after ``t``); the
renewal before an action is skipped while more than ``reserve_s`` of that is left, where ``reserve_s`` is
``remote_call_deadline_s + lease_margin_s`` (:class:`LeaseManager`). The action then ends, at its deadline at
the latest, with the lease still holding for at least ``lease_margin_s``: what the configuration demands of a
lease renewed right before the call (``remote_call_deadline_s + lease_margin_s < lease TTL``). With the defaults
(TTL 45 s, deadline 30 s, margin 10 s) a lease confirmed less than 5 s ago is not renewed before a call; a lease
whose TTL is not longer than ``reserve_s`` is always renewed. What a skipped renewal does not notice is a key
lost *within* its TTL, which only Redis losing it can cause (restart without persistence, failover, a manual
``DEL``): the lease is no proof, the fencing value refuses such a worker's save, and the renewal right before a
save is never skipped.

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
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from streams import metrics
from streams.config import Settings
from streams.coordination.redisstage import REDIS_POOL_EXHAUSTED as REDIS_POOL_EXHAUSTED
from streams.coordination.redisstage import REDIS_UNAVAILABLE as REDIS_UNAVAILABLE
from streams.coordination.redisstage import Arg, LuaScript, RedisCommand, RedisStage
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
    **tls: Any,
) -> aioredis.Redis:
    """A redis-py asyncio client with bounded command and connect timeouts (seconds; ``connect_timeout_s``
    defaults to ``socket_timeout_s``) on a :class:`WaitingConnectionPool` of ``max_connections``
    (``Settings.redis_max_connections``) that waits up to ``pool_timeout_s`` for a free one.

    The timeouts make a port that accepts but never answers look like an outage instead of a hang. A command
    whose pooled connection turns out closed (Redis restarted since it was last used: redis-py 8 does not check
    a pooled connection before reuse) is sent once more on a fresh connection; the lease commands are safe to
    repeat (``SET NX ... GET`` then reads back our own token: acquired; the scripts compare the token).
    Timeouts are not repeated: a silent Redis is reported as unavailable after one socket timeout. ``tls``:
    redis-py's ``ssl_*`` arguments (:func:`redis_tls_kwargs`).
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
        **tls,
    )
    return aioredis.Redis.from_pool(pool)


def redis_tls_kwargs(settings: Settings) -> dict[str, Any]:
    """redis-py's TLS keyword arguments for a ``rediss://`` URL: CA bundle, client certificate and key, host name
    check (``STREAMS_REDIS_SSL_*``); empty when none is set (the URL alone decides)."""
    out: dict[str, Any] = {}
    if settings.redis_ssl_ca_file:
        out["ssl_ca_certs"] = settings.redis_ssl_ca_file
    if settings.redis_ssl_cert_file:
        out["ssl_certfile"] = settings.redis_ssl_cert_file
        out["ssl_keyfile"] = settings.redis_ssl_key_file
    if not settings.redis_ssl_check_hostname:
        out["ssl_check_hostname"] = False
    return out


def redis_for(settings: Settings, socket_timeout_s: float, **kwargs: Any) -> aioredis.Redis:
    """The product's Redis client for ``settings``: :func:`make_redis` on ``redis_url`` with its TLS settings, or,
    with ``STREAMS_REDIS_SENTINELS``, the master the sentinels name ``redis_sentinel_master`` (redis-py's
    ``Sentinel.master_for``: user, password, database and TLS from ``redis_url``; the sentinels' own password
    ``redis_sentinel_password``). ``kwargs`` as :func:`make_redis` takes them."""
    url = settings.redis_url.get_secret_value()
    tls = redis_tls_kwargs(settings)
    if not settings.redis_sentinels:
        return make_redis(url, socket_timeout_s, **kwargs, **tls)
    from redis.asyncio.sentinel import Sentinel

    parts = urlsplit(url)
    sentinels = [
        (host, int(port))
        for host, _, port in (address.strip().rpartition(":") for address in settings.redis_sentinels.split(","))
    ]
    connect_timeout_s = kwargs.get("connect_timeout_s") or socket_timeout_s
    sentinel_password = settings.redis_sentinel_password.get_secret_value() or None
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        sentinels,
        sentinel_kwargs={"password": sentinel_password, "socket_timeout": socket_timeout_s},
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        db=int(parts.path.lstrip("/") or 0),
        ssl=parts.scheme == "rediss",
        **tls,
    )
    client: aioredis.Redis = sentinel.master_for(
        settings.redis_sentinel_master,
        max_connections=kwargs.get("max_connections", 100),
        retry=Retry(NoBackoff(), retries=1, supported_errors=(redis.exceptions.ConnectionError,)),
        decode_responses=False,
    )
    return client


class Lease:
    """One acquired lease: its key, its own owner token and TTL.

    Use :meth:`renew_if_due` before acting on the lease (a remote call, a claim), :meth:`renew` where it must be
    confirmed whatever the time (before a save), and :meth:`release` when done.

    Attributes:
        confirmed_until_monotonic: the ``time.monotonic()`` until which the key is ours at the earliest (the
            submission time of the last acquisition or renewal that answered "ours", plus its TTL); ``-inf`` once
            a renewal found the lease lost. See the module docstring for the rule that uses it.
    """

    def __init__(
        self, manager: LeaseManager, key: str, token: str, ttl_ms: int, confirmed_at: float | None = None
    ) -> None:
        self.manager = manager
        self.key = key
        self.token = token
        self.ttl_ms = ttl_ms
        self.acquired_monotonic = time.monotonic() if confirmed_at is None else confirmed_at
        self.confirmed_until_monotonic = self.acquired_monotonic + ttl_ms / 1000.0
        self.released = False
        self.left_to_expire = False

    @property
    def ttl_s(self) -> float:
        """The lease TTL in seconds."""
        return self.ttl_ms / 1000.0

    @property
    def renewal_due(self) -> bool:
        """True when :meth:`renew_if_due` would ask Redis: ``manager.reserve_s`` is None (never skip), or no more
        than ``reserve_s`` seconds are left of the last confirmation (module docstring), or the lease was found
        lost."""
        reserve_s = self.manager.reserve_s
        return reserve_s is None or self.confirmed_until_monotonic - time.monotonic() <= reserve_s

    async def renew(self, ttl_ms: int | None = None) -> None:
        """Reset the TTL to ``ttl_ms`` (default: the acquisition TTL) if the key still holds our token.

        Raises:
            LeaseLostError: the key is gone or holds another token (never re-created).
            CoordinationUnavailableError: Redis did not answer.
            CoordinationBusyError: no pooled Redis connection came free in time (nothing sent).
        """
        ttl = self.ttl_ms if ttl_ms is None else ttl_ms
        submitted = time.monotonic()
        until = submitted + ttl / 1000.0
        # Should this renewal run but its answer never come, a shorter TTL would hold from now on.
        self.confirmed_until_monotonic = min(self.confirmed_until_monotonic, until)
        renewed = await self.manager._script(self.manager._renew, self.key, [self.token, ttl])
        if not renewed:
            self.confirmed_until_monotonic = float("-inf")  # lost: never skip a renewal of it again
            raise LeaseLostError(self.key)
        self.confirmed_until_monotonic = until

    async def renew_if_due(self) -> bool:
        """Renew before an action unless the last confirmation still holds long enough (:attr:`renewal_due`; the
        rule, its TTL and margin: module docstring). Returns True when it asked Redis, False when skipped.

        Raises:
            as :meth:`renew`.
        """
        if not self.renewal_due:
            return False
        await self.renew()
        return True

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
            elif not task.cancelled():
                # The call ended while a renewal was answering (lost lease, cancellation): its outcome gives way
                # to the renewal's, but is retrieved, or asyncio would log "Task exception was never retrieved".
                task.exception()

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
            deleted = await self.manager._script(self.manager._release, self.key, [self.token])
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
        stage: the worker's coalescing Redis stage on ``client`` (shared with the rate budget); default: one of
            this manager's own.
        reserve_s: seconds a lease must still hold for :meth:`Lease.renew_if_due` to skip a renewal: the
            worker's ``remote_call_deadline_s + lease_margin_s`` (:meth:`streams.worker.runtime.Runtime.create`);
            None (default): never skip.
    """

    def __init__(
        self, client: aioredis.Redis, ttl_ms: int, *, stage: RedisStage | None = None, reserve_s: float | None = None
    ) -> None:
        self.client = client
        self.ttl_ms = ttl_ms
        self.stage = RedisStage(client) if stage is None else stage
        self.reserve_s = reserve_s
        self._release = LuaScript(RELEASE_LUA)
        self._renew = LuaScript(RENEW_LUA)
        self._unwanted: set[asyncio.Future[bool]] = set()  # releases of cancelled acquisitions, kept until done

    @classmethod
    def from_settings(
        cls, client: aioredis.Redis, settings: Settings, *, stage: RedisStage | None = None
    ) -> LeaseManager:
        """A worker's manager: ``lease_ttl_ms``, and ``reserve_s = remote_call_deadline_s + lease_margin_s`` (the
        renewal rule of the module docstring)."""
        reserve_s = settings.remote_call_deadline_s + settings.lease_margin_s
        return cls(client, settings.lease_ttl_ms, stage=stage, reserve_s=reserve_s)

    async def _script(self, lua: LuaScript, key: str, argv: Sequence[Arg]) -> int:
        """Run ``lua`` on ``key`` through the stage. Raises as :meth:`Lease.renew` (without LeaseLostError)."""
        command = RedisCommand.script(lua, [key], argv, what=f"lease {key!r}", busy_label="script")
        return int(await self.stage.execute(command))

    async def acquire(self, key: str, ttl_ms: int | None = None) -> Lease | None:
        """Try once to take the lease ``key``; None when it is busy (normal, do not spin): another owner holds
        it, or no connection of this worker's Redis pool came free in time (counted in
        ``streams_redis_pool_busy_total``; this worker's own load, never an outage). Try again later either way.

        Raises:
            CoordinationUnavailableError: Redis did not answer; make no claim and no remote call.
        """
        ttl = self.ttl_ms if ttl_ms is None else ttl_ms
        token = secrets.token_hex(16)
        submitted = time.monotonic()
        command = RedisCommand(
            ("SET", key, token, "NX", "PX", ttl, "GET"), f"lease {key!r} (acquire)", "acquire", options={"get": True}
        )
        attempt = asyncio.ensure_future(self.stage.execute(command))
        try:
            held_by = await asyncio.shield(attempt)
        except CoordinationBusyError as exc:
            log.info("lease %s not tried: %s", key, exc)
            return None
        except asyncio.CancelledError:
            # Cancelled (a rebalance) with the SET queued or on the wire: it still runs, and may take the key under a
            # token no one knows. Once it answers, a key it took is released, or the job would be kept from every
            # worker for a whole TTL.
            attempt.add_done_callback(lambda done: self._release_unwanted(done, Lease(self, key, token, ttl)))
            raise
        # None: the key was free and is ours now. Our own token: this command ran twice (its reply was lost and
        # redis-py sent it again, make_redis) and its first run took the key; it is ours as well.
        ours = held_by is None or held_by == token.encode()
        return Lease(self, key, token, ttl, submitted) if ours else None

    def _release_unwanted(self, attempt: asyncio.Future[Any], lease: Lease) -> None:
        """After an acquisition whose caller went away: release ``lease`` if its ``SET`` took the key."""
        if attempt.cancelled() or attempt.exception() is not None:
            return  # not sent, or Redis did not answer: a key taken meanwhile expires by its TTL
        held_by = attempt.result()
        if held_by is None or held_by == lease.token.encode():
            task = asyncio.ensure_future(lease.release())
            self._unwanted.add(task)
            task.add_done_callback(self._unwanted.discard)

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
