"""A harness run against the real broker after a real worker ran: the worker added no topic to the run's five
(Faust's leader topic, ``<app id>-__assignor-__leader``, is disabled), and the run's cleanup left none of them."""

from __future__ import annotations

import io
import uuid
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from streams.config import Settings
from streams_harness.fleet import Fleet
from streams_harness.run import isolated_run
from tests.support import wait_for

pytestmark = pytest.mark.e2e


async def run_topics_on_broker(settings: Settings) -> set[str]:
    """The broker's topics of the run: under its topic prefix or named after its app id."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        names = await admin.list_topics()
    finally:
        await admin.close()
    return {t for t in names if t.startswith(settings.topic_prefix) or t.startswith(f"{settings.app_id}-")}


async def group_state(settings: Settings) -> tuple[str, int]:
    """The run's consumer group as the broker describes it: (state, number of members)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        [response] = await admin.describe_consumer_groups([settings.app_id])
    finally:
        await admin.close()
    _error_code, _group, state, _protocol_type, _protocol, members, *_ = response.groups[0]
    return str(state), len(members)


async def test_a_worker_adds_no_topic_and_a_run_leaves_none(base_settings: Settings, tmp_path: Path) -> None:
    out = io.StringIO()
    async with isolated_run(base_settings, f"t{uuid.uuid4().hex[:10]}", keep=False, out=out) as settings:
        fleet = Fleet(settings, tmp_path)
        try:
            fleet.start()
            await fleet.wait_ready()

            async def joined() -> bool:
                return await group_state(settings) == ("Stable", 1)

            # Past its first subscription (where Faust created its leader topic) and its first assignment.
            await wait_for(joined, 60, "the worker to join its consumer group")
        finally:
            fleet.stop_all()
        assert await run_topics_on_broker(settings) == set(settings.topics.values())
    assert await run_topics_on_broker(settings) == set()
    assert "warning" not in out.getvalue()
