"""A harness run's cleanup against the real broker after a real worker ran: nothing of the run is left, neither
its five topics nor the topic Faust's leader assignor created for its app id (its consumer group)."""

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


async def test_a_run_leaves_no_topic_of_its_app_id_after_its_worker_ran(
    base_settings: Settings, tmp_path: Path
) -> None:
    out = io.StringIO()
    async with isolated_run(base_settings, f"t{uuid.uuid4().hex[:10]}", keep=False, out=out) as settings:
        leader = f"{settings.app_id}-__assignor-__leader"
        fleet = Fleet(settings, tmp_path)
        try:
            fleet.start()
            await fleet.wait_ready()

            async def leader_created() -> bool:
                return leader in await run_topics_on_broker(settings)

            await wait_for(leader_created, 60, f"the worker's Faust to create {leader}")
        finally:
            fleet.stop_all()
        assert await run_topics_on_broker(settings) == {*settings.topics.values(), leader}
    assert await run_topics_on_broker(settings) == set()
    assert "warning" not in out.getvalue()
