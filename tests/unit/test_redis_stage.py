"""The Redis stage's handling of one batch, on an in-process Redis (fakeredis) running the real scripts: a
NOSCRIPT resend that fails fails only the commands it carried; the others' replies stand."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import redis.exceptions

from streams.coordination.lease import RENEW_LUA
from streams.coordination.redisstage import LuaScript, RedisCommand, RedisStage, Sent
from streams.errors import CoordinationUnavailableError


class ResendRefused(RedisStage):
    """The real stage whose second pipeline of a batch (the resend after NOSCRIPT) finds Redis gone."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.pipelines: list[list[str]] = []

    async def _pipeline(self, commands: list[Sent]) -> list[Any]:
        self.pipelines.append([str(args[0]) for args, _ in commands])
        if len(self.pipelines) == 2:
            raise redis.exceptions.ConnectionError("Connection refused (the test's)")
        return await super()._pipeline(commands)


async def test_a_failed_resend_fails_only_the_commands_it_carried() -> None:
    client = fakeredis.FakeAsyncRedis()
    await client.set("lease:held", "tok", px=10_000)
    stage = ResendRefused(client)
    renew = LuaScript(RENEW_LUA)  # never loaded: NOSCRIPT
    acquire = stage.execute(RedisCommand(("SET", "lease:new", "mine", "NX", "PX", 10_000), "lease 'lease:new'", "x"))
    renewal = stage.execute(
        RedisCommand.script(renew, ["lease:held"], ["tok", 20_000], what="lease 'held'", busy_label="x")
    )
    results = await asyncio.gather(acquire, renewal, return_exceptions=True)  # one batch
    assert stage.pipelines == [["SET", "EVALSHA"], ["SCRIPT", "EVAL"]]
    assert results[0] is True  # the SET ran and its caller knows it: the lease is its
    assert isinstance(results[1], CoordinationUnavailableError) and "lease 'held'" in str(results[1])
    assert await client.get("lease:new") == b"mine"
