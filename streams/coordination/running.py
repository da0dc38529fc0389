"""The concurrency budget: jobs running at the provider at once, per account and per model, shared by every worker
process through Redis (docs/budgets-and-expiry.md).

Providers limit two things: requests per unit of time (:mod:`streams.coordination.ratebudget`) and jobs running at
once per account or model (Runway answers ``THROTTLED``; fal queues). This module counts the second.

* A slot is tied to its operation id (a member of a sorted set whose score is the slot's expiry on the Redis clock,
  ``TIME``), one set per account (``remote_account_max_running``) and one per model
  (``remote_model_max_running``); 0 = no limit, and nothing is counted.
* Taken by the dispatcher before its claim (:meth:`RunningSlots.take`); taking it again for the same operation
  only refreshes it (a replay, a re-dispatch). Refreshed by every GET of the job that is not terminal
  (:meth:`RunningSlots.refresh`; a slot that lapsed is not put back: the TTL exceeds the longest delay between two
  polls, a check of the settings, so only a job whose polls waited out an outage runs uncounted). Given back
  when a GET finds the job terminal, or the POST ended ``rejected`` (nothing created) (:meth:`RunningSlots.release`).
* ``stalled`` and ``uncertain`` give nothing back: the job may still run at the provider. Nobody refreshes their
  slot any more, so it lapses ``remote_running_slot_ttl_s`` after the last GET. The same TTL frees the slots of a
  worker that died mid-job: none leaks for longer, and a job still observed by another worker keeps its slot.
* Redis unavailable: no slot can be taken, so no POST is made (the lease rule; the callers wait and resume).

Every slot of one account lives in one Redis Cluster hash slot (:func:`streams.config.budget_key`); the script
builds the per-model key from the account's key, as the model is read from the slot's own record.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import redis.asyncio as aioredis

from streams.config import Settings, budget_key
from streams.coordination.redisstage import LuaScript, RedisCommand, RedisStage
from streams.errors import CoordinationError

log = logging.getLogger(__name__)

#: Most lapsed slots one run of the script drops (a bounded edge: the rest go on the next runs).
PRUNE_MAX = 100

#: The running-job slots of one account. The contract:
#:
#: * KEYS[1]: sorted set of the account's slots (member: operation id, score: expiry in ms on the Redis clock).
#:   KEYS[2]: hash operation id -> model. The model's set is KEYS[1] .. ':' .. model.
#: * ARGV[1] op: ``take``, ``refresh`` or ``release``. ARGV[2] operation id. ARGV[3] TTL (ms). ARGV[4] the
#:   account's limit (0: none). ARGV[5] the model's limit (0: none). ARGV[6] model (``take`` only).
#:   ARGV[7] most lapsed slots dropped first.
#: * Returns ``{granted, account_in_use, model_in_use}``: ``take``: 1 when the operation holds a slot now (already
#:   held: refreshed), else 0; ``refresh``: 1 when the operation held a slot (extended), else 0; ``release``: 1
#:   when a slot was given back. The counts are after the operation.
RUNNING_LUA = """
local op = ARGV[1]
local id = ARGV[2]
local ttl = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[7]))
for _, gone in ipairs(lapsed) do
  local m = redis.call('HGET', KEYS[2], gone)
  if m then
    redis.call('ZREM', KEYS[1] .. ':' .. m, gone)
    redis.call('HDEL', KEYS[2], gone)
  end
  redis.call('ZREM', KEYS[1], gone)
end
local model = redis.call('HGET', KEYS[2], id)
if op == 'take' and not model then
  model = ARGV[6]
  local account_limit = tonumber(ARGV[4])
  local model_limit = tonumber(ARGV[5])
  if (account_limit > 0 and redis.call('ZCARD', KEYS[1]) >= account_limit)
     or (model_limit > 0 and redis.call('ZCARD', KEYS[1] .. ':' .. model) >= model_limit) then
    return {0, redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[1] .. ':' .. model)}
  end
  redis.call('HSET', KEYS[2], id, model)
end
if not model then
  return {0, redis.call('ZCARD', KEYS[1]), 0}
end
local model_key = KEYS[1] .. ':' .. model
if op == 'release' then
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', model_key, id)
  redis.call('HDEL', KEYS[2], id)
else
  redis.call('ZADD', KEYS[1], now + ttl, id)
  redis.call('ZADD', model_key, now + ttl, id)
end
local longest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if longest[2] then
  local keep = math.max(1, tonumber(longest[2]) - now)
  redis.call('PEXPIRE', KEYS[1], keep)
  redis.call('PEXPIRE', KEYS[2], keep)
  redis.call('PEXPIRE', model_key, keep)
end
return {1, redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', model_key)}
"""


@dataclass(frozen=True)
class SlotAnswer:
    """One answer of the script: ``granted`` (see :data:`RUNNING_LUA`), then the slots in use of the account and
    of the operation's model."""

    granted: bool
    account_in_use: int
    model_in_use: int


class RunningSlots:
    """The running-job slots of the account ``settings.remote_account`` on one Redis client.

    Args:
        client: a redis-py asyncio client (the worker's).
        settings: the limits, the TTL, the account and the key prefix.
        stage: the worker's coalescing Redis stage on ``client``; default: one of its own.
    """

    def __init__(self, client: aioredis.Redis, settings: Settings, *, stage: RedisStage | None = None) -> None:
        self.client = client
        self.settings = settings
        self.stage = RedisStage(client) if stage is None else stage
        self._script = LuaScript(RUNNING_LUA)

    @property
    def limited(self) -> bool:
        """True when a limit is set (else nothing is counted and every call returns at once)."""
        return self.settings.remote_account_max_running > 0 or self.settings.remote_model_max_running > 0

    def keys(self) -> list[str]:
        """The account's set of slots and its hash operation id -> model (the model's set: the first + ``:model``)."""
        return [budget_key(self.settings, "running", "slots"), budget_key(self.settings, "running", "models")]

    async def _run(self, op: str, operation_id: str, model: str = "") -> SlotAnswer:
        s = self.settings
        args: list[str | int] = [
            op,
            operation_id,
            math.ceil(s.remote_running_slot_ttl_s * 1000),
            s.remote_account_max_running,
            s.remote_model_max_running,
            model,
            PRUNE_MAX,
        ]
        what = f"the running-job slots of account {s.remote_account!r}"
        command = RedisCommand.script(self._script, self.keys(), args, what=what, busy_label="running slots")
        granted, account_in_use, model_in_use = await self.stage.execute(command)
        return SlotAnswer(bool(int(granted)), int(account_in_use), int(model_in_use))

    async def take(self, operation_id: str, model: str) -> SlotAnswer:
        """Take a slot for ``operation_id`` running ``model``, when both the account and the model have room (one
        already held: refreshed, granted).

        Raises:
            CoordinationUnavailableError: Redis did not answer (make no POST).
            CoordinationBusyError: no pooled Redis connection came free in time (make no POST; ask again soon).
        """
        if not self.limited:
            return SlotAnswer(True, 0, 0)
        return await self._run("take", operation_id, model)

    async def refresh(self, operation_id: str) -> None:
        """Extend the slot of ``operation_id``, whose job a GET just found not terminal, by the TTL from now (a lapsed
        slot is not put back). Best effort: a Redis failure is logged (the next GET extends it)."""
        if self.limited:
            await self._best_effort("refresh", operation_id)

    async def release(self, operation_id: str) -> None:
        """Give back the slot of ``operation_id`` (its job is terminal, or none was created). Best effort: a Redis
        failure is logged and the slot lapses after ``remote_running_slot_ttl_s``."""
        if self.limited:
            await self._best_effort("release", operation_id)

    async def _best_effort(self, op: str, operation_id: str) -> None:
        try:
            await self._run(op, operation_id)
        except CoordinationError as exc:
            log.warning(
                "running-job slot not %s (%s); it lapses within %.0f s (STREAMS_REMOTE_RUNNING_SLOT_TTL_S)",
                "given back" if op == "release" else "refreshed",
                exc,
                self.settings.remote_running_slot_ttl_s,
                extra={"operation_id": operation_id},
            )

    async def in_use(self) -> int:
        """Slots of the account in use now, lapsed ones included until the next run of the script drops them.

        Raises:
            redis.exceptions.RedisError: Redis did not answer (an operator's read, not on the call path).
        """
        return int(await self.client.zcard(self.keys()[0]))
