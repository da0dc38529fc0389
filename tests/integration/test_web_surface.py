"""The worker's web server as a stranger and a probe meet it: a real ``streams worker`` on the real services (its
Redis a private ``redis-server`` that the test pauses), read with a plain HTTP client.

Refusals (no or wrong credentials, a foreign Host), the security headers, Faust's own pages off, payloads and
lease tokens kept out of an operation's page, /livez and /readyz telling the truth within their timeout, the
live view's figures coming from the periodic snapshot (not from queries per request), every counter and gauge
exported from the start.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from streams.config import Settings, lease_key
from streams.coordination.lease import LeaseManager, make_redis
from streams.ledger.store import Ledger
from streams.setup.admin import create_topics, delete_topics
from streams_harness.fleet import Fleet, Worker
from streams_harness.redis_server import PrivateRedis
from tests.conftest import SESSION_ID
from tests.support import wait_for

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-" + uuid.uuid4().hex
USER, PASSWORD = "oncall", "pa55-" + uuid.uuid4().hex
BEARER = {"Authorization": f"Bearer {TOKEN}"}
SSN = "078-05-1120"
REQUEST = json.dumps({"input": {"prompt": f"my SSN is {SSN}", "max_tokens": 3}})
SOURCE = json.dumps({"app": "billing", "customer_note": f"SSN {SSN}"})


@pytest.fixture
async def private_redis(tmp_path: Path) -> AsyncIterator[PrivateRedis]:
    if not PrivateRedis.available():
        pytest.skip("no redis-server on the PATH (scripts/setup installs one)")
    (tmp_path / "redis").mkdir()
    server = PrivateRedis(tmp_path / "redis")
    await server.start()
    yield server
    server.resume()
    server.stop()


@pytest.fixture
async def surface_settings(migrated: Settings, private_redis: PrivateRedis) -> AsyncIterator[Settings]:
    """One worker's settings: own topics, group and lease keys, the private Redis, credentials set, a snapshot
    every hour (so that the first one is the only one a test sees), no remote API."""
    tag = uuid.uuid4().hex[:8]
    settings = migrated.replace(
        topic_prefix=f"test-{SESSION_ID}-{tag}.",
        app_id=f"streams-surface-{tag}",
        lease_key_prefix=f"t{tag}",
        remote_base_url="http://127.0.0.1:1",
        redis_url=private_redis.url,
        web_auth_token=TOKEN,
        web_auth_user=USER,
        web_auth_password=PASSWORD,
        web_snapshot_interval_s=3600.0,
        web_probe_timeout_s=1.0,
    )
    await create_topics(settings)
    yield settings
    await delete_topics(settings)


@contextlib.asynccontextmanager
async def worker_of(settings: Settings, log_dir: Path) -> AsyncIterator[Worker]:
    fleet = Fleet(settings, log_dir)
    worker = fleet.start("surface")
    try:
        await fleet.wait_ready(timeout_s=90)
        yield worker
    finally:
        fleet.stop_all(timeout_s=30)


async def first_snapshot(c: httpx.AsyncClient, worker: Worker) -> dict[str, object]:
    """The overview's JSON once the worker's first snapshot is in."""
    answers: list[httpx.Response] = []

    async def taken() -> bool:
        answers.append(await c.get(worker.url + "/?format=json", headers=BEARER))
        return answers[-1].status_code == 200

    await wait_for(taken, 30, "the worker's first snapshot")
    data = answers[-1].json()
    assert isinstance(data, dict)
    return data


async def test_refusals_headers_and_hidden_payloads(
    surface_settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    op = f"surface-{uuid.uuid4().hex[:8]}"
    assert await Ledger(pool, "seed").accept(op, REQUEST, submitted_at_ms=1_700_000_000_000, source_text=SOURCE)
    redis = make_redis(surface_settings.redis_url.get_secret_value(), 1.0)
    lease = await LeaseManager(redis, 60_000).acquire(lease_key(surface_settings, "observe", op))
    assert lease is not None
    try:
        async with worker_of(surface_settings, tmp_path) as worker, httpx.AsyncClient(timeout=10) as c:
            # Unauthenticated, wrong token, wrong password: 401, a fixed body, the challenge, nothing else.
            basic_wrong = base64.b64encode(f"{USER}:nope".encode()).decode()
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {basic_wrong}"}):
                for path in ("/", "/?format=json", f"/operations/{op}?format=json", "/router/", "/table/"):
                    r = await c.get(worker.url + path, headers=headers)
                    assert (r.status_code, r.text) == (401, "authentication required\n"), (path, headers)
                    assert r.headers["WWW-Authenticate"].startswith('Bearer realm="streams"')
                    assert SSN not in r.text and lease.token not in r.text
            # Right credentials, either kind.
            basic = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
            await first_snapshot(c, worker)
            for headers in (BEARER, {"Authorization": f"Basic {basic}"}):
                r = await c.get(worker.url + "/", headers=headers)
                assert r.status_code == 200 and "generation-streams: live view" in r.text
            # A foreign Host is not answered, even with credentials.
            r = await c.get(worker.url + "/", headers={**BEARER, "Host": "evil.example"})
            assert (r.status_code, r.text) == (421, "host not served here\n")
            r = await c.get(worker.url + "/livez", headers={"Host": "evil.example:6066"})
            assert r.status_code == 421
            # Security headers on every answer, refusals included.
            for r in (await c.get(worker.url + "/", headers=BEARER), await c.get(worker.url + "/")):
                assert r.headers["X-Content-Type-Options"] == "nosniff"
                assert r.headers["X-Frame-Options"] == "DENY"
                assert "default-src 'none'" in r.headers["Content-Security-Policy"]
                assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]
            # Faust's own pages are off.
            for path in ("/router/", "/table/", "/graph/", "/stats/"):
                assert (await c.get(worker.url + path, headers=BEARER)).status_code == 404, path
            # The operation's page: no payload, no lease token; the lease itself is shown.
            r = await c.get(f"{worker.url}/operations/{op}?format=json", headers=BEARER)
            assert r.status_code == 200
            detail = r.json()
            assert detail["operation"]["request"] is None and detail["operation"]["source"] is None
            assert "operation.request" in detail["hidden"]
            assert [x["key"] for x in detail["leases"]] == [lease.key]
            assert "owner_token" not in detail["leases"][0]
            page = await c.get(f"{worker.url}/operations/{op}", headers=BEARER)
            for text in (r.text, page.text):
                assert SSN not in text and "billing" not in text and lease.token not in text
            assert "hidden (STREAMS_WEB_SHOW_PAYLOADS shows it)" in page.text
            # The probes and /metrics stay open (each switchable).
            assert (await c.get(worker.url + "/livez")).status_code == 200
            assert (await c.get(worker.url + "/metrics")).status_code == 200
    finally:
        await lease.release()
        await redis.aclose()


async def test_probes_tell_the_truth_within_their_timeout(
    surface_settings: Settings, private_redis: PrivateRedis, tmp_path: Path
) -> None:
    async with worker_of(surface_settings, tmp_path) as worker, httpx.AsyncClient(timeout=10) as c:
        r = await c.get(worker.url + "/readyz")
        assert r.status_code == 200, r.text
        ready = r.json()
        assert ready["ready"] is True and ready["reasons"] == []
        assert {k: v["ok"] for k, v in ready["checks"].items()} == {"postgres": True, "redis": True, "kafka": True}
        consumed = ("submissions", "polls", "cancellations")  # the topics the worker's agents read
        assigned = surface_settings.partitions * len(consumed)
        assert ready["checks"]["kafka"]["detail"] == f"{assigned} partitions assigned"
        live = await c.get(worker.url + "/livez")
        assert (live.status_code, live.json()) == (200, {"live": True, "reasons": []})

        private_redis.pause()  # connections stay open, nothing answers
        try:
            started = time.monotonic()
            r = await c.get(worker.url + "/readyz")
            took_s = time.monotonic() - started
            assert r.status_code == 503, r.text
            body = r.json()
            assert body["ready"] is False and body["checks"]["redis"]["ok"] is False
            assert body["checks"]["postgres"]["ok"] is True and body["checks"]["kafka"]["ok"] is True
            assert [reason.split(":")[0] for reason in body["reasons"]] == ["redis"]
            assert took_s < surface_settings.web_probe_timeout_s + 2.0  # bounded, not hanging
            healthz = await c.get(worker.url + "/healthz")  # the old probe says the same now
            assert healthz.status_code == 503 and healthz.json()["checks"]["redis"]["ok"] is False
            assert (await c.get(worker.url + "/livez")).status_code == 200  # alive: restarting would not help
        finally:
            private_redis.resume()
        assert (await c.get(worker.url + "/readyz")).status_code == 200


async def test_figures_come_from_the_snapshot_and_every_series_is_exported(
    surface_settings: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    async with worker_of(surface_settings, tmp_path) as worker, httpx.AsyncClient(timeout=10) as c:
        before = await first_snapshot(c, worker)
        states = before["states"]
        assert isinstance(states, dict)
        counts = dict(await pool.fetch("SELECT state::text, count(*)::int FROM operations GROUP BY 1"))
        backlog = await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
        op = f"surface-{uuid.uuid4().hex[:8]}"
        assert await Ledger(pool, "seed").accept(op, REQUEST, submitted_at_ms=1_700_000_000_000)
        after = (await c.get(worker.url + "/?format=json", headers=BEARER)).json()
        # The next snapshot is an hour away: the new operation is not counted yet, and the snapshot's time is
        # the same (a request runs no query).
        assert after["states"] == states and after["snapshot"] == before["snapshot"]

        text = (await c.get(worker.url + "/metrics")).text
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        submissions = surface_settings.topic("submissions")
        # Counters that never fired are there, at 0.
        assert samples[("streams_fencing_refusals_total", (("stage", "observe"),))] == 0
        assert samples[("streams_lease_lost_total", (("action", "submit"),))] == 0
        assert samples[("streams_remote_calls_total", (("method", "POST"), ("outcome", "rate_limited")))] == 0
        assert samples[("streams_dead_letters_total", (("reason", "schema"), ("topic", submissions)))] == 0
        # The gauges, against the ledger as the snapshot read it (before the operation was added).
        for state in ("accepted", "uncertain", "stalled", "succeeded"):
            assert samples[("streams_operations", (("state", state),))] == counts.get(state, 0), state
        for state in ("uncertain", "stalled"):
            assert samples[("streams_decision_waiting", (("state", state),))] == counts.get(state, 0)
            assert ("streams_decision_oldest_age_seconds", (("state", state),)) in samples
        assert samples[("streams_outbox_unpublished", ())] == backlog
        assert samples[("streams_consumer_lag", (("topic", submissions),))] == 0
        assert samples[("streams_partitions_blocked", (("agent", "dispatch"),))] == 0
        assert samples[("streams_snapshot_timestamp_seconds", ())] > 0
