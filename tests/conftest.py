"""Shared fixtures. Integration and end-to-end tiers talk to the real services started by scripts/setup.

Isolation: tests use the ``streams_test`` database (tables truncated per test), topics prefixed with a
per-session id, a per-test Redis key prefix, and a fresh consumer group per worker app.
"""

from __future__ import annotations

import os
import uuid

import pytest

from streams.config import Settings

TEST_DATABASE_URL = os.environ.get(
    "STREAMS_TEST_DATABASE_URL", "postgresql://streams:streams@127.0.0.1:5432/streams_test"
)
SESSION_ID = uuid.uuid4().hex[:8]


@pytest.fixture(scope="session")
def base_settings() -> Settings:
    """Settings for the test session: test database, prefixed topics, short TTLs."""
    return Settings.from_env().replace(
        database_url=TEST_DATABASE_URL,
        topic_prefix=f"test-{SESSION_ID}.",
        app_id=f"streams-test-{SESSION_ID}",
        partitions=4,
        lease_ttl_ms=2000,
        remote_call_deadline_s=1.4,
        lease_margin_s=0.5,
        visibility_timeout_s=3.0,
        lease_busy_retry_s=0.2,
        poll_scheduler_interval_s=0.05,
        relay_interval_s=0.02,
        http_read_timeout_s=2.0,
        submit_retry_deadline_s=20.0,
        submitting_stale_after_s=30.0,
        web_enabled=False,
    )
