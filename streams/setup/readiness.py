"""Readiness of the backing services: ready for what the workers do, not a port that answers.

* Kafka: a group coordinator is found for a throwaway consumer group and describes it. A broker that has just
  started answers on its port before it can do that (its ``__consumer_offsets`` topic is created on the first
  coordinator look-up); a describe does not create the group, so nothing is left behind.
* PostgreSQL: the configured role logs in to the configured database and answers a query.
* Redis: a throwaway key (``<lease key prefix>:ready:<random>``, 10 s TTL) is SET, read back with GET and deleted.

Transient errors (connection refused, the database starting up, Redis loading its data, the broker's retriable
errors) are retried with tenacity until the deadline; anything else fails at once. ``streams ready`` and
``scripts/services up`` use :func:`wait_ready`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import redis.exceptions
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential, wait_random

from streams.config import Settings
from streams.coordination.lease import redis_for
from streams.errors import KafkaAdminError, ServiceNotReadyError, error_summary
from streams.ledger import connect_options
from streams.ledger.pool import CONNECT_CONFIG_ERRORS, connect_config_error, database_address
from streams.outages import is_outage
from streams.setup.admin import KafkaAdmin

log = logging.getLogger(__name__)

SERVICES = ("postgres", "redis", "kafka")
#: Redis key of a readiness probe (one per check, expires by itself).
READY_KEY_FORMAT = "{prefix}:ready:{token}"
READY_KEY_TTL_MS = 10_000
#: Backoff between readiness attempts (exponential with jitter, seconds).
RETRY_INITIAL_S = 0.1
RETRY_MAX_S = 1.0
RETRY_JITTER_S = 0.05
#: Seconds between two log lines saying why a service is still waited for (the first failure is logged at once).
WAIT_LOG_INTERVAL_S = 5.0
#: How often a watched server process is checked for having exited (seconds).
PID_CHECK_INTERVAL_S = 0.2


class WaitLog:
    """Says why a service is waited for: the first failed attempt at once, then at most one line every
    ``interval_s`` (with the attempts made since), each naming the service and the last error (e.g. PostgreSQL's
    ``TooManyConnectionsError: sorry, too many clients already``). ``clock`` gives seconds."""

    def __init__(
        self, service: str, interval_s: float = WAIT_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.service = service
        self.interval_s = interval_s
        self.clock = clock
        self.started = clock()
        self._last: float | None = None
        self._attempts = 0

    def failed(self, exc: BaseException | None) -> None:
        """One attempt failed with ``exc`` and will be retried."""
        self._attempts += 1
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            return
        self._last = now
        log.warning(
            "%s not ready after %.1f s (%d attempt%s), waiting: %s",
            self.service,
            now - self.started,
            self._attempts,
            "s" * (self._attempts != 1),
            error_summary(exc) if exc is not None else "no reason given",
        )


async def _retry_transient(check: Callable[[], Awaitable[str]], deadline_s: float, service: str) -> str:
    waits = WaitLog(service)
    retrying = AsyncRetrying(
        retry=retry_if_exception(is_outage),
        stop=stop_after_delay(deadline_s),
        wait=wait_exponential(multiplier=RETRY_INITIAL_S, max=RETRY_MAX_S) + wait_random(0, RETRY_JITTER_S),
        before_sleep=lambda state: waits.failed(state.outcome.exception() if state.outcome is not None else None),
        reraise=True,
    )
    return await retrying(check)


def _failure(what: str, exc: BaseException, deadline_s: float) -> str:
    """``what`` failed: still an outage at the deadline, or a definite refusal (not retried)."""
    if is_outage(exc):
        return f"{what} within {deadline_s:.0f} s (last error: {error_summary(exc)})"
    return f"{what}: refused with {error_summary(exc)}"


async def check_postgres(settings: Settings, deadline_s: float) -> str:
    """Log in to ``settings.database_url`` and run a query; returns the server version.

    Raises:
        DatabaseConfigError: the settings are wrong (a refused login, no such database, a URL that does not
            parse): what to fix, never retried.
        ServiceNotReadyError: no answer within ``deadline_s``, or another definite refusal.
    """
    database_url = settings.database_url.get_secret_value()

    async def check() -> str:
        attempt_s = min(5.0, deadline_s)
        conn = await connect_options.connect(
            database_url,
            timeout=attempt_s,
            command_timeout=attempt_s,  # a server that took the login and stopped answering: the next attempt
            **connect_options.connect_kwargs(database_url, settings.database_statement_cache_size),  # 0: PgBouncer
        )
        try:
            version: str = await conn.fetchval("SELECT current_setting('server_version')")
            return f"PostgreSQL {version}"
        finally:
            await conn.close()

    try:
        return await _retry_transient(check, deadline_s, f"postgres ({database_address(database_url)})")
    except CONNECT_CONFIG_ERRORS as exc:
        raise connect_config_error(database_url, exc) from exc
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise ServiceNotReadyError(
            "postgres", _failure(f"{database_address(database_url)} did not answer a query", exc, deadline_s)
        ) from exc


#: The oldest Redis the leases work on: an acquisition is ``SET key token NX PX ttl GET`` (NX with GET: 7.0).
MIN_REDIS_VERSION = (7, 0)


def redis_version_refusal(version: str) -> str | None:
    """Why a Redis of ``version`` (``INFO server`` ``redis_version``, e.g. ``"7.0.15"``) cannot serve the leases,
    or None when it can (:data:`MIN_REDIS_VERSION`). An unreadable version is refused as well."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        found = ()
    if len(found) == 2 and found >= MIN_REDIS_VERSION:
        return None
    wanted = ".".join(map(str, MIN_REDIS_VERSION))
    return f"Redis {wanted} or later is required (leases are taken with SET NX ... GET); this server is {version!r}"


async def check_redis(settings: Settings, deadline_s: float) -> str:
    """Check the server's version (:func:`redis_version_refusal`), SET a throwaway key with a TTL, GET it back
    and DEL it; returns the server version.

    Raises:
        ServiceNotReadyError: no answer within ``deadline_s``, a refusal, a server too old for the leases, or GET
            not returning what SET stored.
    """
    key = READY_KEY_FORMAT.format(prefix=settings.lease_key_prefix, token=uuid.uuid4().hex)

    async def check() -> str:
        client = redis_for(settings, min(5.0, deadline_s), max_connections=2)
        try:
            info = await client.info("server")
            version = str(info.get("redis_version", "?"))
            refusal = redis_version_refusal(version)
            if refusal is not None:
                raise ServiceNotReadyError("redis", refusal)
            await client.set(key, b"ready", px=READY_KEY_TTL_MS)
            value = await client.get(key)
            await client.delete(key)
            if value != b"ready":
                raise ServiceNotReadyError("redis", f"GET {key} returned {value!r} right after SET stored b'ready'")
            return f"Redis {version}"
        finally:
            await client.aclose()

    try:
        return await _retry_transient(check, deadline_s, "redis")
    except (OSError, TimeoutError, redis.exceptions.RedisError) as exc:
        raise ServiceNotReadyError(
            # a SecretUrl formats with its password masked
            "redis",
            _failure(f"{settings.redis_url} did not answer SET/GET", exc, deadline_s),
        ) from exc


async def check_kafka(settings: Settings, deadline_s: float) -> str:
    """Find the group coordinator of a throwaway consumer group and describe the group; returns the coordinator.

    Raises:
        ServiceNotReadyError: the broker could not coordinate a consumer group within ``deadline_s``.
    """
    group_id = f"{settings.app_id}-ready-{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    try:
        async with KafkaAdmin(settings, deadline_s=deadline_s) as admin:
            coordinator = await admin.find_coordinator(group_id, deadline_s - (time.monotonic() - started))
            await admin.describe_group(group_id, deadline_s - (time.monotonic() - started))
    except KafkaAdminError as exc:
        raise ServiceNotReadyError(
            "kafka", f"{settings.kafka_bootstrap} cannot coordinate a consumer group yet ({exc})"
        ) from exc
    return f"group coordinator: broker {coordinator}"


CHECKS: dict[str, Callable[[Settings, float], Awaitable[str]]] = {
    "postgres": check_postgres,
    "redis": check_redis,
    "kafka": check_kafka,
}


def _process_alive(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie awaiting its parent counts as exited)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    except PermissionError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def _watch_pid(service: str, pid: int) -> str:
    while _process_alive(pid):
        await asyncio.sleep(PID_CHECK_INTERVAL_S)
    raise ServiceNotReadyError(service, f"its server process {pid} exited while we waited for it to become ready")


async def wait_ready(
    settings: Settings, services: list[str], deadline_s: float, pids: dict[str, int] | None = None
) -> dict[str, tuple[str, float]]:
    """Check ``services`` (names from :data:`SERVICES`) concurrently, each within ``deadline_s``.

    ``pids`` maps a service to its server process: its exit fails that check at once instead of at the deadline.
    Returns ``{service: (what it answered, seconds it took)}``.

    Raises:
        ServiceNotReadyError: the first service that failed (the others are cancelled).
    """

    async def one(service: str) -> tuple[str, float]:
        started = time.monotonic()
        check = asyncio.ensure_future(CHECKS[service](settings, deadline_s))
        waiters: set[asyncio.Future[str]] = {check}
        if pids and service in pids:
            waiters.add(asyncio.ensure_future(_watch_pid(service, pids[service])))
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            answer = done.pop().result()
        finally:
            for waiter in waiters:
                waiter.cancel()
        return answer, time.monotonic() - started

    tasks = [asyncio.ensure_future(one(service)) for service in services]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return dict(zip(services, results, strict=True))
