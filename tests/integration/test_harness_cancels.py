"""The harness's cancellations on the real topic: one at its submission time is sent at once, one while running
waits until the ledger states show its job id saved, then its staggered lag (streams_harness.cancels)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping

import pytest

from streams.clients.follow import read_topic_to_end
from streams.config import Settings
from streams_harness.cancels import WHILE_RUNNING, PlannedCancel, publish_cancellations

pytestmark = pytest.mark.integration


async def keys_on_topic(settings: Settings, ops: set[str]) -> dict[str, int]:
    """Operation id -> Kafka timestamp (ms) of the cancellations of ``ops`` on the topic."""
    return {
        r.value["operation_id"]: r.timestamp_ms
        for r in await read_topic_to_end(settings, "cancellations")
        if r.value["operation_id"] in ops
    }


async def test_a_while_running_cancellation_waits_for_the_job_id(migrated: Settings) -> None:
    tag = uuid.uuid4().hex[:8]
    first, running = f"first-{tag}", f"running-{tag}"
    states = {running: "accepted"}

    async def read_states(ids: list[str]) -> Mapping[str, str]:
        return {op: states[op] for op in ids if op in states}

    plan = [PlannedCancel(0.0, first), PlannedCancel(0.0, running, WHILE_RUNNING, 0.3)]
    task = asyncio.create_task(publish_cancellations(migrated, plan, time.monotonic(), read_states))
    try:
        async with asyncio.timeout(30):
            while first not in (seen := await keys_on_topic(migrated, {first, running})):
                await asyncio.sleep(0.05)
        assert running not in seen and not task.done()  # still accepted: no job id saved, nothing sent
        states[running] = "submitted"
        saved_ms = time.time() * 1000
        assert await asyncio.wait_for(task, 30) == 2
    finally:
        task.cancel()
    sent = await keys_on_topic(migrated, {first, running})
    assert set(sent) == {first, running}
    assert sent[running] >= saved_ms + 300 - 50  # its lag after the job id was seen (Kafka's ms clock)
