"""One coalescing Redis stage per worker: the lease and rate-budget commands of all its tasks, one round trip
per batch.

Every command a worker's tasks send for leases (:mod:`streams.coordination.lease`: ``SET NX PX``, the renew and release
scripts) and for the rate budget (:mod:`streams.coordination.ratebudget`: the GCRA script) goes through one
:class:`RedisStage`. Its :class:`~streams.coalesce.Coalescer` gathers the commands of the tasks that are at a
Redis step at the same moment and sends them as one pipeline (``transaction=False``: no ``MULTI``; each
command runs on its own, as if sent alone), so a round trip carries many operations. Each caller gets its own
reply, or its own exception:

* no pooled connection came free within ``redis_pool_timeout_s``: :class:`CoordinationBusyError` for every
  caller of the batch (nothing was sent; this worker's own load, never an outage), counted in
  ``streams_redis_pool_busy_total`` under each command's label;
* Redis refused, reset or stayed silent past the socket timeout: :class:`CoordinationUnavailableError` for
  every caller of the batch;
* an error reply to one command (e.g. ``WRONGTYPE``): that caller alone gets it, as redis-py raises it.

Scripts are sent by SHA (``EVALSHA``) without redis-py's ``Script`` objects in the pipeline: redis-py 8.1's
asyncio ``Pipeline`` sends ``SCRIPT EXISTS`` before every execute that holds one, a second round trip per batch.
A ``NOSCRIPT`` reply (the script cache was flushed: ``SCRIPT FLUSH``, Redis restarted without its cache) means
that command did not run; only those commands are sent again, as ``EVAL`` with the script's text (which cannot
answer ``NOSCRIPT``), after a ``SCRIPT LOAD`` of each script concerned (so the next batches find it by SHA), in
one more round trip. A flushed cache is therefore never read as "lost" or "held"
(``tests/integration/test_redis_stage.py``).

A command whose pooled connection turns out closed (Redis restarted since it was last used) is sent once more
on a fresh connection with its whole batch (redis-py's retry, :func:`streams.coordination.lease.make_redis`). The batch
may
have run already (the connection dropped after Redis ran it, before its replies were read), so every command
sent here gives the same answer when run twice: an acquisition's ``SET NX ... GET`` reads back its own token,
the renew and release scripts compare the token, a rate budget refund is given back once
(``tests/integration/test_redis_stage.py``, a relay that cuts the replies).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from streams import metrics
from streams.coalesce import LINGER_UNDER_LOAD_S, Coalescer
from streams.errors import CoordinationBusyError, CoordinationUnavailableError

#: Errors that mean "Redis did not answer": no claim may be made and no remote call without a lease.
#: :data:`REDIS_POOL_EXHAUSTED` is a subclass of ``redis.exceptions.ConnectionError``: catch it first.
REDIS_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    OSError,
    asyncio.TimeoutError,
)

#: No pooled connection free (raised by :class:`streams.coordination.lease.WaitingConnectionPool` after its wait): not
# an
#: outage.
REDIS_POOL_EXHAUSTED = redis.exceptions.MaxConnectionsError

#: Most commands in one pipeline. A batch is as large as the tasks at a Redis step at once (at most the agent
#: slots, ``dispatcher_concurrency + observer_concurrency``); this only bounds a pathological queue.
REDIS_MAX_BATCH = 256

#: Most pipelines on the wire at once, each on its own pooled connection; further commands wait for the next.
#: One, as the ledger's statements (:data:`streams.ledger.batching.BATCH_IN_FLIGHT`): fewer round trips per
#: observation than two (by ``streams bench``: CHANGELOG.md); a command waits at most for the pipeline on the
#: wire, then goes in the next.
REDIS_MAX_IN_FLIGHT = 1

#: A value Redis accepts as a command argument.
Arg = str | bytes | int | float

#: A command as put in a pipeline: its arguments and redis-py's options for parsing its reply.
Sent = tuple[tuple[Arg, ...], Mapping[str, Any]]


class LuaScript:
    """A Lua script sent by its SHA1 (``EVALSHA``); ``text`` is sent instead only after a ``NOSCRIPT``.

    Args:
        text: the script; its ``KEYS``/``ARGV``/return contract is documented where it is defined.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()  # Redis names scripts by their SHA1


@dataclass(frozen=True, slots=True, eq=False)
class RedisCommand:
    """One command for the stage.

    Attributes:
        args: the command as sent, e.g. ``("SET", key, token, "NX", "PX", ttl_ms)`` or ``("EVALSHA", sha,
            number of keys, *keys, *argv)`` (see :meth:`script`).
        what: what the command is for, in error messages (``"lease 'app:observe:op-1'"``).
        busy_label: the ``action`` label of ``streams_redis_pool_busy_total`` when the pool was full.
        lua: the script an ``EVALSHA`` runs (its text is sent again after a ``NOSCRIPT``); None otherwise.
        options: redis-py's options for parsing the reply (``{"get": True}``: a ``SET ... GET`` answers the old
            value as it is, not as True/None).
    """

    args: tuple[Arg, ...]
    what: str
    busy_label: str
    lua: LuaScript | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def script(
        cls, lua: LuaScript, keys: Sequence[Arg], argv: Sequence[Arg], *, what: str, busy_label: str
    ) -> RedisCommand:
        """``EVALSHA`` of ``lua`` with ``keys`` (``KEYS[1..]``) and ``argv`` (``ARGV[1..]``)."""
        return cls(("EVALSHA", lua.sha, len(keys), *keys, *argv), what, busy_label, lua)

    def as_eval(self) -> tuple[Arg, ...]:
        """The same script call as ``EVAL <text>`` (for a resend after ``NOSCRIPT``); only for a script call."""
        if self.lua is None:
            raise ValueError(f"{self.args[0]!r} is not a script call")
        return ("EVAL", self.lua.text, *self.args[2:])


class RedisStage:
    """Sends the Redis commands of all of a worker's tasks as pipelined batches on one client.

    Args:
        client: a redis-py asyncio client (:func:`streams.coordination.lease.make_redis`); its pool gives each batch a
            connection.
        max_batch, max_in_flight: see :data:`REDIS_MAX_BATCH`, :data:`REDIS_MAX_IN_FLIGHT`.
        linger_s: see :class:`~streams.coalesce.Coalescer` (:data:`~streams.coalesce.LINGER_UNDER_LOAD_S`).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        max_batch: int = REDIS_MAX_BATCH,
        max_in_flight: int = REDIS_MAX_IN_FLIGHT,
        linger_s: float = LINGER_UNDER_LOAD_S,
    ) -> None:
        self.client = client
        self._coalescer: Coalescer[RedisCommand, Any] = Coalescer(
            "redis", self._flush, max_batch=max_batch, max_in_flight=max_in_flight, linger_s=linger_s
        )

    async def execute(self, command: RedisCommand) -> Any:
        """Send ``command`` in the next batch; returns its reply as redis-py parses it (``SET``: True or None;
        a script: its integer or list).

        Raises:
            CoordinationBusyError: no pooled connection came free in time (nothing was sent).
            CoordinationUnavailableError: Redis did not answer (the command may or may not have run).
            redis.exceptions.ResponseError: Redis answered this command with an error (other than ``NOSCRIPT``).
        """
        return await self._coalescer.submit(command)

    @property
    def in_flight(self) -> int:
        """Pipelines on the wire now."""
        return self._coalescer.in_flight

    @property
    def queued(self) -> int:
        """Commands waiting for the next pipeline."""
        return self._coalescer.queued

    async def drain(self) -> None:
        """Wait until every batch queued or on the wire is done (before closing the client)."""
        await self._coalescer.drain()

    async def _flush(self, commands: list[RedisCommand]) -> list[Any]:
        try:
            replies = await self._pipeline([(c.args, c.options) for c in commands])
        except (*REDIS_UNAVAILABLE, REDIS_POOL_EXHAUSTED) as exc:
            return [_failure(c, exc) for c in commands]
        missing: dict[int, LuaScript] = {}
        for i, (command, reply) in enumerate(zip(commands, replies, strict=True)):
            if isinstance(reply, redis.exceptions.NoScriptError) and command.lua is not None:
                missing[i] = command.lua
        if missing:  # these did not run: load their scripts, send only them again (the others' replies stand)
            scripts = {lua.sha: lua for lua in missing.values()}
            loads: list[Sent] = [(("SCRIPT", "LOAD", lua.text), {}) for lua in scripts.values()]
            try:
                again = (await self._pipeline(loads + [(commands[i].as_eval(), {}) for i in missing]))[len(loads) :]
            except (*REDIS_UNAVAILABLE, REDIS_POOL_EXHAUSTED) as exc:
                again = [_failure(commands[i], exc) for i in missing]
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def _pipeline(self, commands: list[Sent]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for args, options in commands:
            pipe.execute_command(*args, **options)
        return list(await pipe.execute(raise_on_error=False))


def _failure(command: RedisCommand, exc: BaseException) -> CoordinationBusyError | CoordinationUnavailableError:
    """The caller's own exception for a pipeline that failed as a whole (pool full: busy, counted; else down)."""
    if isinstance(exc, REDIS_POOL_EXHAUSTED):  # before REDIS_UNAVAILABLE: a subclass of ConnectionError
        metrics.REDIS_POOL_BUSY.labels(command.busy_label).inc()
        return CoordinationBusyError(f"Redis busy for {command.what}: {exc}")
    return CoordinationUnavailableError(f"Redis unavailable for {command.what}: {exc}")
