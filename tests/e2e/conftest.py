"""Fixtures of the process-level tier: fresh settings, the simulator, a worker fleet, a producer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from streams.clients.submit import SubmissionProducer
from streams.config import Settings
from streams.ledger.pool import create_pool
from streams.setup.admin import create_topics, delete_topics, migrate
from streams_harness.fleet import Fleet
from streams_harness.simulator import SimulatorConfig
from tests.support import LEDGER_TABLES, SimulatorServer, unique_settings

TABLES = LEDGER_TABLES


@pytest.fixture
async def sim() -> AsyncIterator[SimulatorServer]:
    server = SimulatorServer()
    await server.start(SimulatorConfig(port=0, compression=20.0, get_latency_ms=2.0))
    yield server
    await server.stop()


@pytest.fixture
async def fault_settings(base_settings: Settings, sim: SimulatorServer) -> AsyncIterator[Settings]:
    """Per-test settings: fresh topics/group/lease keys, short TTLs, the test simulator; ledger emptied."""
    settings = unique_settings(
        base_settings,
        remote_base_url=sim.url,
        lease_ttl_ms=2000,
        visibility_timeout_s=3.0,
        kafka_session_timeout_s=6.0,
        kafka_heartbeat_interval_s=1.0,
        http_read_timeout_s=2.0,
        submitting_stale_after_s=8.0,
        submit_retry_deadline_s=3.0,
        http_connect_timeout_s=1.0,
        http_write_timeout_s=1.0,
        coordination_retry_cap_s=0.5,
        dispatcher_concurrency=8,
        observer_concurrency=16,
    )
    migrate(settings.database_url.get_secret_value())
    await create_topics(settings)
    pool = await create_pool(settings.database_url.get_secret_value(), min_size=1, max_size=2)
    await pool.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    await pool.close()
    yield settings
    await delete_topics(settings)


@pytest.fixture
async def ledger_pool(fault_settings: Settings) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(fault_settings.database_url.get_secret_value(), min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest.fixture
async def fleet(fault_settings: Settings, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(fault_settings, tmp_path)
    yield f
    f.stop_all()


@pytest.fixture
async def producer(fault_settings: Settings) -> AsyncIterator[SubmissionProducer]:
    async with SubmissionProducer(fault_settings) as p:
        yield p
