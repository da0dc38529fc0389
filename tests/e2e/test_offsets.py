"""No committed offset passes an event still being handled, and a SIGKILL then loses nothing.

One partition of ``generation.submissions`` holds five submissions; the third is held unfinished while the
others finish, either by its ``INSERT`` (another transaction holds an uncommitted row with the same operation
id, so the worker's ``INSERT ... ON CONFLICT`` waits on it) or by its Redis submit lease (held by the test).
The consumer group's committed offset for that partition is read from Kafka (admin client) meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from streams.clients.submit import submission
from streams.config import Settings, lease_key
from streams.coordination.lease import LeaseManager, make_redis
from streams_harness.fleet import Fleet
from tests.support import SimulatorServer, provider_request, wait_for

pytestmark = pytest.mark.e2e

FINAL = ("succeeded", "failed", "canceled", "rejected", "uncertain")
PARTITION = 0
HEAD = 2  # offset (and index) of the submission held unfinished
#: Faust commits acknowledged offsets every ``broker_commit_interval`` (2.8 s by default). Proving that an
#: offset is *never* committed needs an observation window: three commit intervals after the others finished.
OBSERVE_S = 3 * 2.8


class Offsets:
    """Reads the consumer group's committed offset of one partition; keeps every sample."""

    def __init__(self, settings: Settings) -> None:
        self.admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        self.group = settings.app_id
        self.tp = TopicPartition(settings.topic("submissions"), PARTITION)
        self.samples: list[int | None] = []

    def runs(self) -> str:
        """The samples as runs, e.g. ``None x81, 2 x12, 5 x23``."""
        out: list[list[Any]] = []
        for v in self.samples:
            if out and out[-1][0] == v:
                out[-1][1] += 1
            else:
                out.append([v, 1])
        return ", ".join(f"{v} x{n}" for v, n in out)

    async def committed(self) -> int | None:
        offsets = await self.admin.list_consumer_group_offsets(self.group, partitions=[self.tp])
        meta = offsets.get(self.tp)
        value = meta.offset if meta is not None and meta.offset >= 0 else None
        self.samples.append(value)
        return value

    async def observe(self, seconds: float) -> list[int | None]:
        """Sample every 250 ms for ``seconds``; returns those samples."""
        start = len(self.samples)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await self.committed()
            await asyncio.sleep(0.25)
        return self.samples[start:]


@pytest.fixture
async def offsets(fault_settings: Settings) -> AsyncIterator[Offsets]:
    o = Offsets(fault_settings)
    await o.admin.start()
    yield o
    await o.admin.close()


async def produce_to_one_partition(settings: Settings, ids: list[str]) -> list[int]:
    """Publish one submission per id, all to partition 0, in order; returns their offsets."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        offsets = []
        for op in ids:
            value = submission(op, provider_request(100, 20))
            meta = await producer.send_and_wait(
                settings.topic("submissions"), value, key=op.encode(), partition=PARTITION
            )
            offsets.append(meta.offset)
        return offsets
    finally:
        await producer.stop()


@contextlib.asynccontextmanager
async def insert_blocked(settings: Settings, operation_id: str) -> AsyncIterator[None]:
    """Hold an uncommitted row with ``operation_id``: a worker's ``INSERT`` of it waits until we roll back."""
    conn = await asyncpg.connect(settings.database_url.get_secret_value())
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.execute(
            "INSERT INTO operations (operation_id, request, updated_by) VALUES ($1, '{}'::jsonb, 'test-blocker')",
            operation_id,
        )
        yield
    finally:
        await tx.rollback()
        await conn.close()


@contextlib.asynccontextmanager
async def submit_lease_held(settings: Settings, operation_id: str) -> AsyncIterator[None]:
    """Hold the operation's Redis submit lease (2 minutes) until the block ends."""
    client = make_redis(settings.redis_url.get_secret_value(), settings.redis_socket_timeout_s)
    lease = await LeaseManager(client, settings.lease_ttl_ms).acquire(
        lease_key(settings, "submit", operation_id), ttl_ms=120_000
    )
    assert lease is not None
    try:
        yield
    finally:
        await lease.release()
        await client.aclose()


def blocker(kind: str, settings: Settings, operation_id: str) -> contextlib.AbstractAsyncContextManager[None]:
    return insert_blocked(settings, operation_id) if kind == "insert" else submit_lease_held(settings, operation_id)


async def states(pool: asyncpg.Pool, ids: list[str]) -> dict[str, str]:
    rows = await pool.fetch("SELECT operation_id, state::text FROM operations WHERE operation_id = ANY($1)", ids)
    return {r["operation_id"]: r["state"] for r in rows}


async def others_past_submitting(pool: asyncpg.Pool, ids: list[str]) -> bool:
    found = await states(pool, [op for i, op in enumerate(ids) if i != HEAD])
    return len(found) == len(ids) - 1 and all(s not in ("accepted", "submitting") for s in found.values())


async def one_job_each(sim: SimulatorServer, ids: list[str]) -> dict[str, Any]:
    records = {op: await sim.get(f"/_sim/operations/{op}") for op in ids}
    return {op: (r["posts"], len(r["jobs"])) for op, r in records.items()}


async def test_committed_offset_never_passes_an_event_in_flight(
    fleet: Fleet, sim: SimulatorServer, ledger_pool: asyncpg.Pool, fault_settings: Settings, offsets: Offsets
) -> None:
    """The third of five submissions is blocked in its INSERT while the other four finish: the committed
    offset may reach 2 (the blocked event's offset) and never pass it; once released, it reaches 5."""
    fleet.start("a")
    await fleet.wait_ready("a")
    prefix = f"off{uuid.uuid4().hex[:6]}"
    ids = [f"{prefix}-{i}" for i in range(5)]
    async with insert_blocked(fault_settings, ids[HEAD]):
        assert await produce_to_one_partition(fault_settings, ids) == [0, 1, 2, 3, 4]
        await wait_for(lambda: others_past_submitting(ledger_pool, ids), 60, "submissions 1, 2, 4, 5 handled")

        async def reached_head() -> bool:
            return (await offsets.committed() or 0) >= HEAD

        await wait_for(reached_head, 30, "the offsets before the blocked event to be committed")
        window = await offsets.observe(OBSERVE_S)
        print("committed offset samples while the head event was blocked:", offsets.runs())
        assert max(v or 0 for v in offsets.samples) == HEAD, offsets.runs()
        assert window and all(v == HEAD for v in window), window

    async def all_committed() -> bool:
        return await offsets.committed() == 5

    await wait_for(all_committed, 30, "offset 5 committed once the blocked event finished")
    assert (await states(ledger_pool, [ids[HEAD]]))[ids[HEAD]] not in ("accepted", "submitting")


@pytest.mark.parametrize("kind", ["insert", "lease"])
async def test_worker_killed_while_head_event_in_flight_loses_nothing(
    kind: str,
    fleet: Fleet,
    sim: SimulatorServer,
    ledger_pool: asyncpg.Pool,
    fault_settings: Settings,
    offsets: Offsets,
) -> None:
    """SIGKILL the worker while the third submission is held (INSERT blocked, or submit lease held elsewhere)
    and the others are done; a replacement worker brings every submission to a final state with exactly one
    remote job each (the simulator's record).

    The re-dispatch of operations left ``accepted`` is kept out of it (a stale time of an hour): the killed
    worker's blocked INSERT still completes in its orphaned PostgreSQL backend once the blocker rolls back,
    and re-dispatch would then rescue the operation even with offsets committed past it."""
    a = fleet.start("a", accepted_stale_after_s=3600.0)
    await fleet.wait_ready("a")
    prefix = f"kil{uuid.uuid4().hex[:6]}"
    ids = [f"{prefix}-{i}" for i in range(5)]
    async with blocker(kind, fault_settings, ids[HEAD]):
        await produce_to_one_partition(fault_settings, ids)
        await wait_for(lambda: others_past_submitting(ledger_pool, ids), 60, "submissions 1, 2, 4, 5 handled")

        async def reached_head() -> bool:
            return (await offsets.committed() or 0) >= HEAD

        await wait_for(reached_head, 30, "the offsets before the blocked event to be committed")
        await offsets.observe(OBSERVE_S)  # time for any (wrong) commit past the head event to happen
        a.signal(signal.SIGKILL)
        a.proc.wait()
    print("committed offset samples before the kill:", offsets.runs())
    fleet.start("b", accepted_stale_after_s=3600.0)
    await fleet.wait_ready("b")

    async def all_final() -> bool:
        found = await states(ledger_pool, ids)
        return len(found) == len(ids) and all(s in FINAL for s in found.values())

    try:
        await wait_for(all_final, 90, "every submission final after the replacement worker started")
    finally:
        print("states:", await states(ledger_pool, ids))
    assert await one_job_each(sim, ids) == {op: (1, 1) for op in ids}
    assert set((await states(ledger_pool, ids)).values()) == {"succeeded"}
