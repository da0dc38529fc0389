"""One request budget per provider account, shared by every worker process through Redis.

The provider limits requests per account, not per worker: every worker's calls draw from one budget kept in
Redis, so N workers together stay under the limit whatever N is (docs/guarantees.md, "Rate budget").

* Kinds: ``POST`` (submissions) and ``GET`` (observations) are budgeted apart, each with its rate
  (``remote_post_rate_per_s``, ``remote_get_rate_per_s``; 0 = no pacing) and burst (``remote_*_burst``).
  ``claims`` paces the poll scheduler's claims of due polls at the GET rate (see below).
* Algorithm: GCRA (generic cell rate algorithm) with reservations, in one Lua script (:data:`BUDGET_LUA`) run on
  the Redis clock (``TIME``), so every worker agrees on "now". A request is granted a send time up to
  :data:`RESERVE_HORIZON_S` ahead; the caller sleeps until then. In any window of ``W`` seconds at most
  ``floor(W * rate) + burst`` requests of one kind are granted (:meth:`Pace.window_bound`).
* A 429: its ``Retry-After`` pauses every worker's calls of that kind until it passes (a key with a PX expiry,
  read by the same script); a reservation granted before the pause is void (checked after the sleep), and the
  pace restarts after the pause without a burst. The pause one worker writes is capped at
  ``remote_shared_pause_cap_s`` (a longer ``Retry-After``, or one misread through a skewed clock, delays only
  that worker's own retry), and its key holds who set it (:meth:`RateBudget.pause_record`), also logged.
* Polls slow down before the GET budget runs out: each scheduler round claims no more due polls than the
  ``claims`` budget (the GET rate and burst, shared by all workers, also stopped by a GET pause) grants for the
  next round, and gives back what it did not use. Due polls wait in PostgreSQL, oldest first, instead of
  queueing at observers.
* Redis unavailable (or this worker's Redis pool full): the budget cannot be checked, so no remote call is made
  (the lease rule); callers wait and resume (:class:`~streams.errors.CoordinationUnavailableError`,
  :class:`~streams.errors.CoordinationBusyError`).

Waits happen before a call, never after one: the call's own deadline starts after the wait, and a caller
holding a lease keeps it renewed while it waits (``keep_alive``).

Libraries checked (PyPI): throttled-py 3.5 (GCRA on Redis, async, wait-and-retry), limits 5.8 (fixed and
moving windows), pyrate-limiter 4.5. None reads a provider's pause in the same atomic step as the budget,
reserves a future slot (their waits poll), or gives back an unused batch grant; this is core coordination,
so it is the project's own script.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson
import redis.asyncio as aioredis

from streams import metrics
from streams.config import Settings, budget_key
from streams.coordination.redisstage import LuaScript, RedisCommand, RedisStage
from streams.errors import CoordinationBusyError, CoordinationUnavailableError, RateBudgetDeadlineError

log = logging.getLogger(__name__)

#: How far ahead a request may be granted its send time (s). Longer waits are asked again later, so a 429's
#: pause voids at most this much of reservations, and a waiter asks Redis about once per this period.
RESERVE_HORIZON_S = 1.0

#: Spread (s) of the next asks of waiters told to come back later (beyond the horizon), so they do not all ask
#: Redis at the same instant. After a pause none is added: the pace after it orders them.
WAITER_JITTER_S = 0.1

#: How long a refund's own key is kept (ms): longer than redis-py takes to send a pipeline again on a fresh
#: connection (a socket timeout plus a connect timeout), so a repeated refund finds it.
REFUND_MEMORY_MS = 60_000

#: GCRA in one script. The contract:
#:
#: * KEYS[1]: the kind's state, its theoretical arrival time (TAT; integer microseconds on the Redis clock),
#:   absent when idle; PX expiry when the TAT passes. KEYS[2]: the kind's pause (any value; PX = the pause).
#:   KEYS[3] (``refund`` only): the refund's own key, set for :data:`REFUND_MEMORY_MS` by its first run, so the
#:   same refund run again (its reply lost, redis-py sent its pipeline again) gives nothing back twice.
#: * ARGV[1] op: ``take`` (ask for units), ``check`` (is the kind paused?), ``pause`` (after a 429),
#:   ``refund`` (give units back). ARGV[2] emission interval in microseconds (1e6 / rate; 0 = no pacing).
#:   ARGV[3] burst (>= 1). ARGV[4] count: units wanted (``take``) or given back (``refund``).
#:   ARGV[5] horizon in microseconds (``take``: grant only units that may be sent within it). ARGV[6] pause in
#:   milliseconds (``pause``; a pause never shortens one already set). ARGV[7] (``refund``) how long KEYS[3]
#:   is kept, in milliseconds; (``pause``) the record stored as the pause key's value (who set it): a non-empty
#:   JSON object's text, stored with ``"set_at_ms"`` (epoch ms of the Redis clock) added as its last member.
#: * Returns ``{granted, wait_us, paused, at_us}``. ``take``: ``granted`` units (0..count) with the first one's
#:   send time ``wait_us`` from now (0 = now); or 0 and the time after which asking again can succeed. ``check``:
#:   1 when not paused, else 0 and the pause's rest. ``pause``: 0 and the pause in force. ``refund``: count.
#:   ``paused`` is 1 when a pause decided the answer; ``at_us`` is now + ``wait_us`` on the Redis clock.
#:
#: Unit ``i`` (1-based) of a take may be sent at ``max(now, tat + (i - 1) * T - tau)`` with ``tau = (burst - 1)
#: * T``; a grant moves the TAT by ``granted * T``. After a pause the TAT is at least its end plus ``tau``, so
#: the first request goes when it ends and the next ones at the pace, without a burst.
BUDGET_LUA = """
local op = ARGV[1]
local interval = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local tau = (burst - 1) * interval
local function load_tat()
  local v = tonumber(redis.call('GET', KEYS[1]))
  if v == nil or v < now then return now end
  return v
end
local function store_tat(tat)
  if tat <= now then
    redis.call('DEL', KEYS[1])
  else
    redis.call('SET', KEYS[1], string.format('%d', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
  end
end
local pause_ms = redis.call('PTTL', KEYS[2])
if pause_ms == -1 then
  redis.call('DEL', KEYS[2])
end
if pause_ms < 0 then
  pause_ms = 0
end
if op == 'pause' then
  local ms = tonumber(ARGV[6])
  if ms > pause_ms then
    local record = '1'
    if ARGV[7] then
      record = string.sub(ARGV[7], 1, -2) .. ',"set_at_ms":' .. string.format('%d', math.floor(now / 1000)) .. '}'
    end
    redis.call('SET', KEYS[2], record, 'PX', ms)
    pause_ms = ms
    if interval > 0 then
      local after = now + ms * 1000 + tau
      if load_tat() < after then
        store_tat(after)
      end
    end
  end
  return {0, pause_ms * 1000, 1, now + pause_ms * 1000}
end
if op == 'refund' then
  if KEYS[3] and not redis.call('SET', KEYS[3], '1', 'NX', 'PX', tonumber(ARGV[7])) then
    return {tonumber(ARGV[4]), 0, 0, now}
  end
  if interval > 0 then
    store_tat(math.max(now, load_tat() - tonumber(ARGV[4]) * interval))
  end
  return {tonumber(ARGV[4]), 0, 0, now}
end
if pause_ms > 0 then
  return {0, pause_ms * 1000, 1, now + pause_ms * 1000}
end
if op == 'check' then
  return {1, 0, 0, now}
end
local wanted = tonumber(ARGV[4])
if interval == 0 then
  return {wanted, 0, 0, now}
end
local tat = load_tat()
local room = now + tonumber(ARGV[5]) + tau - tat
if room < 0 then
  return {0, -room, 0, now - room}
end
local granted = math.min(wanted, math.floor(room / interval) + 1)
store_tat(tat + granted * interval)
local first = math.max(now, tat - tau)
return {granted, first - now, 0, first}
"""


class BudgetKind(StrEnum):
    """What a budget counts: the account's POSTs, its GETs, and the poll scheduler's claims (GET pace)."""

    POST = "POST"
    GET = "GET"
    CLAIMS = "claims"


@dataclass(frozen=True)
class Pace:
    """One kind's pace: ``interval_us`` between requests (microseconds, 0 = no pacing) and ``burst`` (requests
    that may go at once after a quiet spell, >= 1)."""

    interval_us: int
    burst: int

    @classmethod
    def from_rate(cls, rate_per_s: float, burst: int) -> Pace:
        """The pace of ``rate_per_s`` requests per second (0 = no pacing) with ``burst``. The interval is rounded
        up to a whole microsecond, so the pace never exceeds the rate.

        Raises:
            ValueError: a negative or non-finite rate, or a burst below 1.
        """
        if not math.isfinite(rate_per_s) or rate_per_s < 0:
            raise ValueError(f"rate must be a finite number >= 0 requests/s, got {rate_per_s!r}")
        if burst < 1:
            raise ValueError(f"burst must be at least 1 request, got {burst!r}")
        return cls(math.ceil(1_000_000 / rate_per_s) if rate_per_s > 0 else 0, burst)

    @property
    def paced(self) -> bool:
        """True when the kind is paced (a rate was set)."""
        return self.interval_us > 0

    def window_bound(self, window_s: float) -> int | None:
        """Most requests granted in any closed window of ``window_s`` seconds: ``floor(W / T) + burst``; None when
        not paced. (GCRA: the ``m``-th grant after one is at least ``(m - burst + 1) * T`` later.)"""
        if not self.paced:
            return None
        return round(window_s * 1_000_000) // self.interval_us + self.burst  # in whole microseconds, as the script


@dataclass(frozen=True)
class Grant:
    """One answer of the script: ``granted`` units, ``wait_s`` (see :data:`BUDGET_LUA`), ``paused`` when a 429's
    pause decided it, and ``at_us``: when the wait ends, in microseconds of the Redis clock (``TIME``)."""

    granted: int
    wait_s: float
    paused: bool
    at_us: int


@dataclass(frozen=True)
class Slot:
    """A slot waited for: ``waited_s`` seconds of waiting (0.0: at once) for the send time ``at_us``
    (microseconds of the Redis clock), the same clock for every worker."""

    waited_s: float
    at_us: int


#: Renews whatever the caller holds (its lease) while it waits; raises when that is lost.
KeepAlive = Callable[[], Awaitable[Any]]


class RateBudget:
    """The rate budget of the provider account ``settings.remote_account`` on one Redis client.

    Args:
        client: a redis-py asyncio client (the worker's, :func:`streams.coordination.lease.make_redis`).
        settings: rates, bursts, the account and the key prefix (:func:`streams.config.budget_key`).
        stage: the worker's coalescing Redis stage on ``client`` (shared with the leases), through which every
            request of the script goes; default: one of this budget's own.
        owner: the worker's name, stored with every pause it sets (:meth:`pause_record`).
    """

    def __init__(
        self, client: aioredis.Redis, settings: Settings, *, stage: RedisStage | None = None, owner: str = "unnamed"
    ) -> None:
        self.client = client
        self.owner = owner
        self.stage = RedisStage(client) if stage is None else stage
        self.settings = settings
        get_pace = Pace.from_rate(settings.remote_get_rate_per_s, settings.remote_get_burst)
        self.paces = {
            BudgetKind.POST: Pace.from_rate(settings.remote_post_rate_per_s, settings.remote_post_burst),
            BudgetKind.GET: get_pace,
            BudgetKind.CLAIMS: get_pace,
        }
        self._script = LuaScript(BUDGET_LUA)

    def _keys(self, kind: BudgetKind) -> list[str]:
        paused_by = BudgetKind.GET if kind is BudgetKind.CLAIMS else kind  # a GET's 429 stops claims too
        return [budget_key(self.settings, kind.value, "tat"), budget_key(self.settings, paused_by.value, "pause")]

    async def _run(
        self,
        kind: BudgetKind,
        op: str,
        count: int = 1,
        horizon_s: float = 0.0,
        pause_s: float = 0.0,
        record: str | None = None,
    ) -> Grant:
        pace = self.paces[kind]
        args: list[str | int] = [
            op,
            pace.interval_us,
            pace.burst,
            count,
            round(horizon_s * 1_000_000),
            math.ceil(pause_s * 1000),
        ]
        keys = self._keys(kind)
        if op == "refund":  # its own key: run twice, it gives back once (BUDGET_LUA)
            keys.append(budget_key(self.settings, kind.value, f"refund:{secrets.token_hex(16)}"))
            args.append(REFUND_MEMORY_MS)
        elif record is not None:
            args.append(record)
        what = f"the {kind} rate budget of account {self.settings.remote_account!r}"
        command = RedisCommand.script(self._script, keys, args, what=what, busy_label="rate budget")
        granted, wait_us, paused, at_us = await self.stage.execute(command)
        return Grant(int(granted), int(wait_us) / 1_000_000, bool(int(paused)), int(at_us))

    async def take(self, kind: BudgetKind, count: int = 1, horizon_s: float = RESERVE_HORIZON_S) -> Grant:
        """Ask for ``count`` (>= 1) units of ``kind`` whose send times fall within ``horizon_s`` seconds.

        Raises:
            CoordinationUnavailableError: Redis did not answer (make no call).
            CoordinationBusyError: no pooled Redis connection came free in time (make no call; ask again soon).
        """
        return await self._run(kind, "take", count, horizon_s)

    async def check(self, kind: BudgetKind) -> Grant:
        """Whether ``kind`` is paused by a 429 (``granted`` 0, the pause's rest in ``wait_s``) or not (1).

        Raises:
            CoordinationUnavailableError: Redis did not answer.
        """
        return await self._run(kind, "check")

    async def refund(self, kind: BudgetKind, count: int) -> None:
        """Give back ``count`` units taken but not used (the scheduler claimed fewer polls than granted).

        Raises:
            CoordinationUnavailableError: Redis did not answer.
        """
        if count > 0 and self.paces[kind].paced:
            await self._run(kind, "refund", count)

    async def pause(self, kind: BudgetKind, seconds: float) -> float:
        """Pause every worker's calls of ``kind`` (``POST`` or ``GET``) for ``seconds`` (a 429's ``Retry-After``),
        recording :attr:`owner` as who set it; a longer pause in force is kept. Returns the pause in force (s).

        Raises:
            CoordinationUnavailableError: Redis did not answer.
        """
        record = orjson.dumps({"by": self.owner, "pause_s": seconds}).decode()  # set_at_ms: by the script
        grant = await self._run(kind, "pause", pause_s=seconds, record=record)
        return grant.wait_s

    async def pause_record(self, kind: BudgetKind) -> dict[str, Any] | None:
        """Who set the pause of ``kind`` in force: ``{"by", "pause_s", "set_at_ms"}`` (epoch ms of the Redis clock,
        the one every worker's budget runs on, never a worker's own), None when no pause is in force (or it was set
        without a record).

        Raises:
            redis.exceptions.RedisError: Redis did not answer (an operator's read, not on the call path).
        """
        raw = await self.client.get(self._keys(kind)[1])
        if raw is None:
            return None
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        return record if isinstance(record, dict) else None

    async def note_rate_limited(self, kind: BudgetKind, retry_after_s: float) -> None:
        """After a 429 to a call of ``kind``: pause the kind for ``retry_after_s``, at most
        ``remote_shared_pause_cap_s`` (counted in ``streams_rate_budget_pauses_total``; the pause and who set it
        logged). Best effort: with Redis unavailable it is logged, and the caller's own wait before retrying still
        applies (the next call needs Redis anyway)."""
        if retry_after_s <= 0:
            return
        cap_s = self.settings.remote_shared_pause_cap_s
        shared_s = min(retry_after_s, cap_s)
        if shared_s < retry_after_s:
            log.warning(
                "a 429 to a %s asked for %.1f s; the account's shared pause is capped at %.1f s "
                "(STREAMS_REMOTE_SHARED_PAUSE_CAP_S); this call alone waits the rest",
                kind,
                retry_after_s,
                cap_s,
            )
        try:
            in_force_s = await self.pause(kind, shared_s)
        except (CoordinationUnavailableError, CoordinationBusyError) as exc:
            log.warning("a 429 to a %s could not pause the account's %ss: %s", kind, kind, exc)
            return
        metrics.BUDGET_PAUSES.labels(kind.value).inc()
        log.info("429 to a %s: every worker's %ss paused for %.3f s, set by %s", kind, kind, in_force_s, self.owner)

    async def wait_for_slot(
        self,
        kind: BudgetKind,
        *,
        keep_alive: KeepAlive | None = None,
        keep_alive_every_s: float = 1.0,
        deadline: float | None = None,
    ) -> Slot:
        """Wait until one call of ``kind`` may be sent now; returns the :class:`Slot` (seconds waited, 0.0 when at
        once, and its send time on the Redis clock).

        While waiting, ``keep_alive`` (the caller's lease renewal) runs every ``keep_alive_every_s`` seconds. A
        reservation is checked against a 429's pause before returning. Waits are counted in
        ``streams_rate_budget_waits_total`` and ``streams_rate_budget_wait_seconds_total``.

        Args:
            deadline: ``time.monotonic()`` value after which no slot is any use to the caller.

        Raises:
            CoordinationUnavailableError: Redis did not answer (make no call; wait and ask again).
            CoordinationBusyError: no pooled Redis connection came free in time (make no call; ask again soon).
            RateBudgetDeadlineError: the next slot comes after ``deadline``.
            Anything ``keep_alive`` raises (e.g. :class:`~streams.errors.LeaseLostError`): the wait is abandoned.
        """
        started = time.monotonic()
        sleeper = KeptAliveSleep(keep_alive, keep_alive_every_s)
        waited = False
        try:
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    raise RateBudgetDeadlineError(kind.value, self.settings.remote_account, "it passed while waiting")
                grant = await self.take(kind)
                if grant.granted and grant.wait_s == 0:
                    return Slot(time.monotonic() - started if waited else 0.0, grant.at_us)
                delay = grant.wait_s
                if not grant.granted and not grant.paused:  # beyond the horizon: spread the waiters' next asks
                    delay += random.uniform(0, WAITER_JITTER_S)
                if deadline is not None and time.monotonic() + grant.wait_s > deadline:
                    why = f"next slot in {grant.wait_s:.3f} s, deadline in {deadline - time.monotonic():.3f} s"
                    raise RateBudgetDeadlineError(kind.value, self.settings.remote_account, why)
                waited = True
                await sleeper.sleep(delay)
                if grant.granted and (await self.check(kind)).granted:
                    return Slot(time.monotonic() - started, grant.at_us)
                # Not granted yet, or paused by a 429 after the reservation (it is void): ask again.
        finally:
            if waited:
                metrics.BUDGET_WAITS.labels(kind.value).inc()
                metrics.BUDGET_WAIT_SECONDS.labels(kind.value).inc(time.monotonic() - started)


class KeptAliveSleep:
    """Sleeps of one wait, calling ``keep_alive`` every ``every_s`` seconds of the whole wait (not of each sleep:
    a wait made of many short sleeps keeps the caller alive too)."""

    def __init__(self, keep_alive: KeepAlive | None, every_s: float) -> None:
        self.keep_alive = keep_alive
        self.every_s = every_s
        self.due = time.monotonic() + every_s

    async def sleep(self, delay_s: float) -> None:
        end = time.monotonic() + delay_s
        while (remaining := end - time.monotonic()) > 0:
            if self.keep_alive is None:
                await asyncio.sleep(remaining)
                return
            await asyncio.sleep(min(remaining, max(0.0, self.due - time.monotonic())))
            if time.monotonic() >= self.due:
                await self.keep_alive()
                self.due = time.monotonic() + self.every_s
