"""``Lease.renewing`` (streams.coordination.lease) when the remote call ends while a renewal is answering: the
renewal's outcome
(lease lost) is what the caller sees, and the call's own failure is retrieved, never left for asyncio to log as
"Task exception was never retrieved" (seen in a soak: a GET abandoned at its deadline while the lease was lost)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import fakeredis
import pytest

from streams.coordination.lease import Lease, LeaseManager
from streams.errors import LeaseLostError


class LostWhileTheCallEnds(Lease):
    """A lease whose renewal answers "lost" only after the call under it has ended (with ``call_ended`` set)."""

    def __init__(self, manager: LeaseManager, call_ended: asyncio.Event) -> None:
        super().__init__(manager, "lease-test:renewing", "token", 3000)
        self.call_ended = call_ended

    async def renew(self, ttl_ms: int | None = None) -> None:
        await self.call_ended.wait()
        raise LeaseLostError(self.key)


async def test_a_call_failing_during_a_lost_renewal_is_retrieved() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        call_ended = asyncio.Event()
        lease = LostWhileTheCallEnds(LeaseManager(fakeredis.FakeAsyncRedis(), 3000), call_ended)

        async def call() -> None:
            await asyncio.sleep(0.01)
            call_ended.set()
            raise TimeoutError("no complete answer within the call deadline")

        with pytest.raises(LeaseLostError):
            await lease.renewing(call(), every_s=0.001)
        gc.collect()  # a task's unretrieved exception is reported when the task is collected
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert [c.get("message") for c in reported] == []


async def test_a_call_answering_before_the_renewal_is_returned() -> None:
    lease = Lease(LeaseManager(fakeredis.FakeAsyncRedis(), 3000), "lease-test:renewing-ok", "token", 3000)

    async def call() -> str:
        await asyncio.sleep(0)
        return "snapshot"

    assert await lease.renewing(call(), every_s=1.0) == "snapshot"
