"""The live view in a real browser: a real ``streams worker`` on the real services with a seeded ledger, its page
opened in Chromium (Debian's ``chromium`` package driven by Playwright), the figures read off the page compared
with the ledger (SQL) and the worker's own /metrics, an operation's link followed to its page. Screenshots are
kept under ``reports/live-view/<session>/`` (the path is printed).

Also: a worker's log is JSON lines by default.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from aiokafka import AIOKafkaProducer

from streams.clients.follow import read_topic_to_end
from streams.config import Settings, lease_key
from streams.coordination.lease import LeaseManager, make_redis
from streams.ledger.store import OUTBOX_RELAY_LOCK_NAME, Ledger
from streams.setup.admin import create_topics, delete_topics
from streams_harness.fleet import Fleet, Worker
from tests.conftest import SESSION_ID
from tests.integration.operators_support import HOSTILE_REASON, STALLED_REASON, Seeded, backdate, seed_ledger
from tests.support import ROOT, wait_for

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
TERMINAL = ("succeeded", "failed", "canceled", "rejected")
#: The outbox relay's advisory lock (streams/ledger/queries/ledger.sql): holding it keeps the outbox still.
#: The live view's bearer token in these tests (STREAMS_WEB_AUTH_TOKEN).
TOKEN = "live-view-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RELAY_LOCK = f"SELECT pg_advisory_xact_lock(hashtext('{OUTBOX_RELAY_LOCK_NAME}'))"


@pytest.fixture
async def worker_settings(migrated: Settings) -> AsyncIterator[Settings]:
    """Settings of one worker with its own topics, consumer group and lease keys; no remote API (nothing seeded
    is due for a POST or a GET)."""
    tag = uuid.uuid4().hex[:8]
    settings = migrated.replace(
        topic_prefix=f"test-{SESSION_ID}-{tag}.",
        app_id=f"streams-live-{tag}",
        lease_key_prefix=f"t{tag}",
        remote_base_url="http://127.0.0.1:1",
        web_auth_token=TOKEN,
        web_snapshot_interval_s=0.5,
    )
    await create_topics(settings)
    yield settings
    await delete_topics(settings)


@contextlib.asynccontextmanager
async def live_worker(settings: Settings, log_dir: Path) -> AsyncIterator[Worker]:
    """A ``streams worker`` process with ``settings`` and its default log format, ready (its /healthz answers),
    stopped on exit."""
    fleet = Fleet(settings, log_dir)
    worker = fleet.start("live")
    try:
        await fleet.wait_ready(timeout_s=90)
        yield worker
    finally:
        fleet.stop_all(timeout_s=30)


async def test_worker_log_is_json_lines(worker_settings: Settings, tmp_path: Path) -> None:
    async with live_worker(worker_settings, tmp_path) as worker:
        async with httpx.AsyncClient(timeout=10) as c:
            assert (await c.get(worker.url + "/livez")).status_code == 200
    lines = [line for line in worker.log_text().splitlines() if line.strip()]
    assert len(lines) > 10
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
    assert any(r["logger"] == "streams.worker.app" and r["message"].startswith("worker ") for r in records)


@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"{CHROMIUM} is absent: install Debian's chromium package (apt-get install -y chromium)",
)
async def test_live_view_in_chromium(
    worker_settings: Settings, pool: asyncpg.Pool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from playwright.async_api import async_playwright

    seeded: Seeded = await seed_ledger(Ledger(pool, "seed-worker"), "live")
    old = seeded.by_state["uncertain"][1]
    await backdate(pool, old, "2 hours 5 minutes")
    # Lease contention: one submitted job due now whose observe lease another holder keeps.
    contended = seeded.by_state["submitted"][0]
    redis = make_redis(worker_settings.redis_url.get_secret_value(), 1.0)
    lease = await LeaseManager(redis, 60_000).acquire(lease_key(worker_settings, "observe", contended))
    assert lease is not None
    await pool.execute("UPDATE operations SET next_poll_at = now() WHERE operation_id = $1", contended)
    # A dead letter: bytes that are not JSON on the submissions topic.
    producer = AIOKafkaProducer(bootstrap_servers=worker_settings.kafka_bootstrap, acks="all")
    await producer.start()
    await producer.send_and_wait(worker_settings.topic("submissions"), b"not json", key=b"x")
    await producer.stop()
    # The outbox stays as it is while this connection holds the relay's lock.
    relay_lock = await pool.acquire()
    hold = relay_lock.transaction()
    await hold.start()
    await relay_lock.execute(RELAY_LOCK)

    shots = ROOT / "reports" / "live-view" / SESSION_ID
    shots.mkdir(parents=True, exist_ok=True)
    try:
        async with live_worker(worker_settings, tmp_path) as worker, async_playwright() as pw:
            busy_labels = {"action": "observe"}
            dead_labels = {"topic": worker_settings.topic("submissions"), "reason": "not_json"}

            async def met_the_lease() -> bool:
                return await worker.metric("streams_lease_busy_total", busy_labels) > 0

            async def dead_lettered() -> bool:
                return await worker.metric("streams_dead_letters_total", dead_labels) > 0

            await wait_for(met_the_lease, 60, "the worker to meet the held lease")
            await wait_for(dead_lettered, 60, "the bad record to be dead-lettered")
            browser = await pw.chromium.launch(executable_path=str(CHROMIUM))
            page = await browser.new_page(viewport={"width": 1300, "height": 900}, extra_http_headers=AUTH)

            async def snapshot_shows(predicate: Callable[[dict[str, Any]], bool]) -> None:
                """Wait until the worker's snapshot (its overview's JSON) satisfies ``predicate``."""

                async def shown() -> bool:
                    async with httpx.AsyncClient(timeout=10) as c:
                        answer = await c.get(worker.url + "/?format=json", headers=AUTH)
                    return answer.status_code == 200 and predicate(answer.json())

                await wait_for(shown, 30, "the worker's snapshot")

            await snapshot_shows(lambda d: d["dead_letter_topic"]["retained"] == 1 and d["outbox"]["unpublished"] > 0)
            await page.goto(worker.url + "/")

            # Operations by state, against the ledger.
            shown = {}
            for span in await page.locator("#states span.count").all():
                shown[await span.get_attribute("data-state")] = int(await span.inner_text())
            counts = {
                r["state"]: r["n"]
                for r in await pool.fetch("SELECT state::text AS state, count(*)::int AS n FROM operations GROUP BY 1")
            }
            assert {s: n for s, n in shown.items() if n} == counts
            assert int(await page.locator("#total").inner_text()) == sum(counts.values()) == 11

            # Throughput over the window, against the transition log.
            window = "at >= date_trunc('minute', now()) - interval '9 minutes'"
            finished = await pool.fetchval(
                f"SELECT count(*) FROM transitions WHERE {window} AND to_state::text = ANY($1::text[])", list(TERMINAL)
            )
            accepted = await pool.fetchval(f"SELECT count(*) FROM transitions WHERE {window} AND to_state='accepted'")
            assert int(await page.locator("#finished").inner_text()) == finished == 5  # 3 succeeded, failed, rejected
            per_minute = [int(x) for x in await page.locator("[data-minute-accepted]").all_inner_texts()]
            assert len(per_minute) == 10 and sum(per_minute) == accepted

            # The uncertain queue: oldest first, ages and reasons as the ledger has them, markup shown as text.
            hostile_op = seeded.by_state["uncertain"][0]
            queue = page.locator("#queue-uncertain")
            assert int(await queue.locator(".queue-count").inner_text()) == 2
            assert await queue.locator("a.op").all_inner_texts() == [old, seeded.by_state["uncertain"][0]]
            ages = [
                float(a or 0)
                for a in [await s.get_attribute("data-age-s") for s in await queue.locator("[data-age-s]").all()]
            ]
            sql_age = await pool.fetchval(
                "SELECT extract(epoch FROM now() - state_entered_at) FROM operations WHERE operation_id=$1", old
            )
            assert 7500 <= ages[0] <= float(sql_age) and ages[1] < 120
            assert (await queue.locator(".reason").all_inner_texts())[1] == HOSTILE_REASON
            assert await queue.locator(".reason b, .reason script").count() == 0
            assert await page.title() == "generation-streams: live view"  # no script of the reason ran
            stalled = page.locator("#queue-stalled")
            assert int(await stalled.locator(".queue-count").inner_text()) == 1
            assert await stalled.locator("a.op").all_inner_texts() == seeded.by_state["stalled"]
            assert await stalled.locator(".reason").all_inner_texts() == [STALLED_REASON]
            job_cells = await stalled.locator("tbody td:nth-child(3)").all_inner_texts()
            assert job_cells == [seeded.job_ids[seeded.by_state["stalled"][0]]]

            # Outbox backlog while the relay is held, against the ledger.
            backlog = await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            assert backlog > 0 and int(await page.locator("#outbox-unpublished").inner_text()) == backlog

            # This worker's counters, against its /metrics (read after the page: counters only grow).
            busy_row = page.locator("#contention tr", has_text="streams_lease_busy_total")
            busy_on_page = int((await busy_row.locator("td").all_inner_texts())[-1])
            busy_now = await worker.metric("streams_lease_busy_total", busy_labels)
            assert 1 <= busy_on_page <= busy_now
            submissions_topic = worker_settings.topic("submissions")
            dead_row = page.locator("#outbox tr", has_text=f"reason=not_json, topic={submissions_topic}")
            assert (await dead_row.locator("td").all_inner_texts())[-1] == "1"
            # Counters that never fired are listed at 0 (every counter is exported from the start).
            fencing = page.locator("#contention tr", has_text="streams_fencing_refusals_total")
            assert await fencing.count() == 3  # stage=submit, observe, reconcile
            assert {(await row.locator("td").all_inner_texts())[-1] for row in await fencing.all()} == {"0"}
            # The dead-letter topic, against Kafka's own offsets read here.
            dead_topic = worker_settings.topic("dead_letter")
            retained = len(await read_topic_to_end(worker_settings, "dead_letter"))
            assert int(await page.locator("#dead-letters-retained").inner_text()) == retained == 1
            assert dead_topic in await page.locator("#outbox").inner_text()
            await page.screenshot(path=str(shots / "overview.png"), full_page=True)

            # The same figures as JSON, for programs.
            async with httpx.AsyncClient(timeout=10) as c:
                as_json = (await c.get(worker.url + "/?format=json", headers=AUTH)).json()
                detail_json = (await c.get(f"{worker.url}/operations/{old}?format=json", headers=AUTH)).json()
                # not an operation id (a NUL reached PostgreSQL and answered 500), and an id nobody submitted
                for path, status in (("%00", 404), ("a%00b", 404), ("%20x", 404), ("no-such-op", 404)):
                    answer = await c.get(f"{worker.url}/operations/{path}", headers=AUTH)
                    assert answer.status_code == status, (path, answer.status_code)
            assert {s: n for s, n in as_json["states"].items() if n} == counts
            assert as_json["outbox"]["unpublished"] == backlog and as_json["throughput"]["finished"] == finished
            assert as_json["dead_letter_topic"]["retained"] == retained and as_json["worker"]
            assert [r["operation_id"] for r in as_json["queues"]["uncertain"]["rows"]] == [old, hostile_op]
            assert detail_json["operation"]["state"] == "uncertain" and len(detail_json["transitions"]) == 3

            # Follow the hostile operation's link to its page: the same data as `streams operations show`.
            hostile = hostile_op
            await queue.locator("a.op", has_text=hostile).click()
            await page.wait_for_url(f"**/operations/{hostile}")
            row = await pool.fetchrow(
                "SELECT state::text AS state, fencing_token FROM operations WHERE operation_id=$1", hostile
            )
            assert await page.locator("#state").inner_text() == row["state"] == "uncertain"
            assert int(await page.locator("#fencing-token").inner_text()) == row["fencing_token"]
            assert await page.locator("#reason").inner_text() == HOSTILE_REASON
            assert await page.locator("#reason-code").inner_text() == "unknown_outcome"
            transitions = await pool.fetch(
                "SELECT to_state::text FROM transitions WHERE operation_id=$1 ORDER BY id", hostile
            )
            assert await page.locator("#transitions tbody tr td:nth-child(4)").all_inner_texts() == [
                t["to_state"] for t in transitions
            ]
            assert await page.locator("#remote-calls tbody tr").count() == 1
            await page.screenshot(path=str(shots / "uncertain-operation.png"), full_page=True)

            # The contended operation's page names the lease and its TTL, never the holder's token.
            await page.goto(worker.url + "/operations/" + contended)
            lease_cells = await page.locator("#leases tbody tr td").all_inner_texts()
            assert lease_cells[:2] == ["observe", lease.key] and 0 < int(lease_cells[2]) <= 60_000
            assert lease.token not in await page.content()

            # Release the relay: the backlog drains, and the page says so.
            await hold.rollback()
            await pool.release(relay_lock)
            relay_lock = None

            async def drained() -> bool:
                left: int = await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
                return left == 0

            await wait_for(drained, 30, "the relay to publish the backlog")
            await snapshot_shows(lambda d: d["outbox"]["unpublished"] == 0)
            await page.goto(worker.url + "/")
            assert int(await page.locator("#outbox-unpublished").inner_text()) == 0
            succeeded = seeded.by_state["succeeded"][0]
            await page.goto(worker.url + "/operations/" + succeeded)
            outputs = await page.locator("#outputs tbody tr td:nth-child(4)").all_inner_texts()
            assert outputs == [f"output:{succeeded}:out-{i}" for i in range(2)]
            assert "-" not in await page.locator("#outputs tbody tr td:nth-child(5)").all_inner_texts()  # published
            await page.screenshot(path=str(shots / "succeeded-operation.png"), full_page=True)
            await browser.close()
    finally:
        if relay_lock is not None:
            await hold.rollback()
            await pool.release(relay_lock)
        await lease.release()
        await redis.aclose()
    with capsys.disabled():
        print(f"\nlive view screenshots: {shots}/overview.png, uncertain-operation.png, succeeded-operation.png")
