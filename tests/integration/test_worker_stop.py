"""A worker's stop is bounded (``STREAMS_STOP_TIMEOUT_S``, :class:`streams.worker.process.StopDeadline`): a real
worker told to stop exits in time, cleanly when its stop finishes before the deadline, with status 5 and one
ERROR line when it does not (with Kafka frozen it ran until Kafka came back)."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from streams.config import Settings
from streams.errors import EXIT_UNAVAILABLE
from streams.setup.admin import create_topics, delete_topics
from streams_harness.fleet import Fleet

pytestmark = pytest.mark.integration


@pytest.fixture
async def own_settings(migrated: Settings) -> AsyncIterator[Settings]:
    tag = uuid.uuid4().hex[:8]
    settings = migrated.replace(
        topic_prefix=f"stop-{tag}.", app_id=f"streams-stop-{tag}", lease_key_prefix=f"s{tag}", partitions=2
    )
    await create_topics(settings)
    yield settings
    await delete_topics(settings)


async def exit_status(fleet: Fleet, name: str, timeout_s: float) -> int | None:
    proc = fleet.workers[name].proc
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while proc.poll() is None and loop.time() < deadline:
        await asyncio.sleep(0.1)
    return proc.poll()


async def test_a_stop_past_its_deadline_ends_the_process_with_status_5_and_says_so(
    own_settings: Settings, tmp_path: Path
) -> None:
    fleet = Fleet(own_settings, tmp_path)
    try:
        worker = fleet.start("late", stop_timeout_s=0.2)  # a clean stop takes seconds: past this deadline
        await fleet.wait_ready(timeout_s=90)
        worker.signal(signal.SIGTERM)
        assert await exit_status(fleet, "late", 20.0) == EXIT_UNAVAILABLE
        assert "streams worker did not stop within 0.2 s (STREAMS_STOP_TIMEOUT_S" in worker.log_text()
    finally:
        fleet.stop_all(timeout_s=30)


async def test_a_stop_within_its_deadline_is_a_clean_exit(own_settings: Settings, tmp_path: Path) -> None:
    fleet = Fleet(own_settings, tmp_path)
    try:
        worker = fleet.start("in-time")
        await fleet.wait_ready(timeout_s=90)
        worker.signal(signal.SIGTERM)
        assert await exit_status(fleet, "in-time", 30.0) == 0
        assert "did not stop within" not in worker.log_text()
    finally:
        fleet.stop_all(timeout_s=30)
