"""The rule that skips renewals that confirm nothing (streams.coordination.lease): a renewal before an action is
skipped only
while the last confirmation leaves the key ours for more than ``reserve_s``; never for a lease found lost,
never on a manager without a reserve. Leases on an in-process Redis (fakeredis) running the real scripts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import fakeredis
import pytest

from streams.config import Settings
from streams.coordination.lease import Lease, LeaseManager
from streams.coordination.redisstage import RedisCommand, RedisStage
from streams.errors import CoordinationUnavailableError, LeaseLostError


class CountingStage(RedisStage):
    """The real stage, counting the commands it is given by their first word."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.sent: list[str] = []

    async def execute(self, command: RedisCommand) -> Any:
        self.sent.append(str(command.args[0]))
        return await super().execute(command)


def manager(server: fakeredis.FakeServer, reserve_s: float | None) -> tuple[LeaseManager, CountingStage]:
    client = fakeredis.FakeAsyncRedis(server=server)
    stage = CountingStage(client)
    return LeaseManager(client, 30_000, stage=stage, reserve_s=reserve_s), stage


async def acquired(leases: LeaseManager, key: str, ttl_ms: int | None = None) -> Lease:
    lease = await leases.acquire(key, ttl_ms)
    assert lease is not None
    return lease


async def test_a_lease_confirmed_for_longer_than_the_reserve_is_not_renewed() -> None:
    leases, stage = manager(fakeredis.FakeServer(), reserve_s=1.9)
    lease = await acquired(leases, "k")  # ours for 30 s from now at the earliest
    assert not lease.renewal_due
    assert await lease.renew_if_due() is False
    assert stage.sent == ["SET"]  # nothing sent for the skipped renewal


async def test_a_renewal_becomes_due_when_the_confirmation_falls_to_the_reserve() -> None:
    leases, stage = manager(fakeredis.FakeServer(), reserve_s=1.9)
    lease = await acquired(leases, "k", ttl_ms=2000)  # the test settings' TTL: 0.1 s above the reserve
    deadline = time.monotonic() + 5
    while not lease.renewal_due:
        assert time.monotonic() < deadline, "the renewal never became due"
        await asyncio.sleep(0.01)
    assert await lease.renew_if_due() is True
    assert stage.sent == ["SET", "EVALSHA"]
    assert not lease.renewal_due  # confirmed again for 2 s
    assert lease.confirmed_until_monotonic - time.monotonic() > 1.9


async def test_a_lease_whose_ttl_does_not_exceed_the_reserve_is_always_renewed() -> None:
    leases, stage = manager(fakeredis.FakeServer(), reserve_s=1.9)
    lease = await acquired(leases, "k", ttl_ms=1900)
    assert lease.renewal_due and await lease.renew_if_due() is True
    assert stage.sent == ["SET", "EVALSHA"]


async def test_without_a_reserve_every_renewal_is_sent() -> None:
    leases, stage = manager(fakeredis.FakeServer(), reserve_s=None)
    lease = await acquired(leases, "k")
    assert lease.renewal_due and await lease.renew_if_due() is True
    assert stage.sent == ["SET", "EVALSHA"]


async def test_a_lease_found_lost_is_never_skipped_again() -> None:
    server = fakeredis.FakeServer()
    leases, stage = manager(server, reserve_s=1.9)
    lease = await acquired(leases, "k")
    await fakeredis.FakeAsyncRedis(server=server).set("k", "someone-else", px=30_000)
    with pytest.raises(LeaseLostError):
        await lease.renew()
    assert lease.renewal_due
    with pytest.raises(LeaseLostError):  # asked again, not skipped on the strength of the acquisition
        await lease.renew_if_due()
    assert stage.sent == ["SET", "EVALSHA", "EVALSHA"]


async def test_an_unanswered_renewal_never_extends_the_confirmation_and_a_shorter_one_lowers_it() -> None:
    server = fakeredis.FakeServer()
    leases, _ = manager(server, reserve_s=1.9)
    lease = await acquired(leases, "k")
    confirmed = lease.confirmed_until_monotonic
    server.connected = False
    with pytest.raises(CoordinationUnavailableError):
        await lease.renew()
    assert lease.confirmed_until_monotonic == confirmed  # the acquisition still holds: the key is ours till then
    with pytest.raises(CoordinationUnavailableError):
        await lease.renew(ttl_ms=1000)  # it may have run: from now on the key may hold for 1 s only
    assert lease.confirmed_until_monotonic - time.monotonic() <= 1.0
    assert lease.renewal_due


def test_a_workers_manager_reserves_the_call_deadline_plus_the_lease_margin() -> None:
    settings = Settings().replace(lease_ttl_ms=45_000, remote_call_deadline_s=30.0, lease_margin_s=10.0)
    leases = LeaseManager.from_settings(fakeredis.FakeAsyncRedis(), settings)
    assert (leases.ttl_ms, leases.reserve_s) == (45_000, 40.0)
