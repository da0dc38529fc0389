"""The outbox relay's process killed between publishing and marking: the batch is published again with the
same event ids, and downstream deduplication leaves each output once."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import asyncpg
import pytest

from streams.clients.follow import EventDeduplicator, read_topic_to_end
from streams.clients.submit import SubmissionProducer
from streams.config import Settings
from streams_harness import faults
from streams_harness.fleet import Fleet
from tests.support import provider_request, wait_for

pytestmark = pytest.mark.e2e


async def test_relay_killed_between_publish_and_mark(
    fleet: Fleet, fault_settings: Settings, producer: SubmissionProducer, ledger_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    hook = tmp_path / "kill-after-publish"
    hook.touch()
    a = fleet.start("a", faults={faults.KILL_AFTER_PUBLISH_FILE: str(hook)})
    await fleet.wait_ready("a")
    prefix = f"relay{uuid.uuid4().hex[:6]}"
    ids = [f"{prefix}-{i}" for i in range(5)]
    for op in ids:
        await (await producer.submit(op, provider_request(10, 5)))

    async def a_died() -> bool:
        return a.proc.poll() is not None

    await wait_for(a_died, 60, "worker A to kill itself after publishing a batch with outputs")
    assert not hook.exists()
    unmarked = await ledger_pool.fetchval(
        "SELECT count(*) FROM outbox WHERE topic_role = 'outputs_delivered' AND published_at IS NULL"
        " AND operation_id LIKE $1",
        prefix + "%",
    )
    assert unmarked > 0  # published, never marked
    fleet.start("b")

    async def all_delivered() -> bool:
        pending = await ledger_pool.fetchval(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND operation_id LIKE $1", prefix + "%"
        )
        final = await ledger_pool.fetchval(
            "SELECT count(*) FROM operations WHERE operation_id LIKE $1 AND state = 'succeeded'", prefix + "%"
        )
        return bool(pending == 0 and final == len(ids))

    await wait_for(all_delivered, 90, "worker B to finish and relay everything")
    rows = await ledger_pool.fetch(
        "SELECT operation_id, output_id, event_id FROM outbox WHERE topic_role = 'outputs_delivered'"
        " AND operation_id LIKE $1",
        prefix + "%",
    )
    assert len({(r["operation_id"], r["output_id"]) for r in rows}) == len(rows)  # one row per output
    events = [
        r.value
        for r in await read_topic_to_end(fault_settings, "outputs_delivered")
        if r.value["operation_id"].startswith(prefix)
    ]
    counts = Counter(e["event_id"] for e in events)
    assert set(counts) == {r["event_id"] for r in rows}
    assert set(counts.values()) <= {1, 2} and 2 in counts.values()  # the killed batch appears twice
    dedupe = EventDeduplicator()
    assert sorted(e["event_id"] for e in events if dedupe.first_time(e["event_id"])) == sorted(counts)
