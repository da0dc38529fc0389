"""The main flow on the secured and replicated services of ``scripts/prod-services``: SASL_SSL and mutual TLS
brokers, Redis over TLS with an ACL user, PgBouncer in transaction mode, a Sentinel failover, and the 3-broker
cluster with its kills and a partition growth. Every figure is read from the harness's report (the simulator's,
the ledger's and Kafka's records); the stall after each broker kill is printed (``-s`` shows it).

The services are found with ``scripts/prod-services config`` (``PROD_SERVICES_PORT_OFFSET`` passes through);
``up`` of those a test needs is idempotent. Locally a failed ``up`` skips; in CI (``CI`` set) it fails.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiokafka.partitioner import murmur2
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import NoPermissionError

from streams.clients.submit import SubmissionProducer
from streams.config import Settings
from streams.ledger.pool import create_pool
from streams.oncall.snapshot import CONSUMED_ROLES, KafkaFigures
from streams.setup.admin import KafkaAdmin, delete_topics
from streams_harness.fleet import Fleet, Worker
from streams_harness.run import collect_report, progress, publication_times_ms, settled
from tests.support import ROOT, SimulatorServer, provider_request, unique_settings, wait_for

PROD = ROOT / "scripts" / "prod-services"

#: Seconds a flow of this file may take to settle after its last submission.
SETTLE_TIMEOUT_S = 180.0


def prod_services(*args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    """``scripts/prod-services ARGS`` (its environment inherited: ``PROD_SERVICES_PORT_OFFSET``)."""
    return subprocess.run([str(PROD), *args], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


def prod_config(*names: str) -> dict[str, str]:
    """``up`` of ``names`` (idempotent), then ``config --show-secrets`` as a dict; skip locally, fail in CI."""
    up = prod_services("up", *names)
    if up.returncode != 0:
        why = f"scripts/prod-services up {' '.join(names)} failed: {up.stderr[-800:]}"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (.ci/run must start them before the tests)")
        pytest.skip(why)
    out = prod_services("config", "--show-secrets").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def streams_cli(settings: Settings, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``streams ARGS`` with exactly ``settings`` as its ``STREAMS_*`` environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_") or k.startswith("STREAMS_TEST_")}
    env.update(settings.to_env())
    return subprocess.run(
        [sys.executable, "-m", "streams", *args], env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
    )


def checked(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args[3:]} exited {result.returncode}: {result.stderr[-1500:]}"
    return result.stdout


def flow_settings(base: Settings, sim: SimulatorServer, **changes: Any) -> Settings:
    """Fresh topics, group and run account, short TTLs (as the e2e tier's), the test's simulator, ``changes``."""
    settings = unique_settings(
        base,
        remote_base_url=sim.url,
        lease_ttl_ms=2000,
        visibility_timeout_s=3.0,
        kafka_session_timeout_s=6.0,
        kafka_heartbeat_interval_s=1.0,
        http_read_timeout_s=2.0,
        submitting_stale_after_s=8.0,
        submit_retry_deadline_s=3.0,
        coordination_retry_cap_s=0.5,
        dispatcher_concurrency=8,
        observer_concurrency=16,
    )
    return settings.replace(remote_account=settings.app_id, **changes)


def assert_promises(report: dict[str, Any], n: int) -> None:
    """Every operation final, one POST (one job) each, at most one GET in flight per job, outputs once."""
    promises = {
        "operations_missing": report["operations_missing"],
        "operations_final": report["operations_final"],
        "duplicate_creations": report["duplicate_creations"]["provider"],
        "max_jobs_per_operation": report["max_jobs_per_operation"],
        "max_gets_in_flight_per_job": report["max_gets_in_flight_per_job"],
        "output_duplicates_after_dedupe": report["output_duplicates_after_dedupe"],
        "outputs_undelivered": report["outputs_undelivered"],
        "state_regressions": report["state_regressions"],
    }
    assert promises == {
        "operations_missing": 0,
        "operations_final": n,
        "duplicate_creations": 0,
        "max_jobs_per_operation": 1,
        "max_gets_in_flight_per_job": 1,
        "output_duplicates_after_dedupe": 0,
        "outputs_undelivered": 0,
        "state_regressions": 0,
    }, report


async def submit_steadily(
    settings: Settings, prefix: str, n: int, rate_per_s: float, sent: list[str] | None = None
) -> list[str]:
    """Submit ``n`` operations ``<prefix>-<i>`` at ``rate_per_s``; returns their ids once Kafka acked them all."""
    ids = sent if sent is not None else []
    pending = []
    started = time.monotonic()
    async with SubmissionProducer(settings) as producer:
        for i in range(n):
            delay = started + i / rate_per_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            operation_id = f"{prefix}-{i:05d}"
            pending.append(await producer.submit(operation_id, provider_request(40, 4)))
            ids.append(operation_id)
        await asyncio.gather(*pending)
    return ids


async def wait_settled(settings: Settings, prefix: str, n: int, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    pool = await create_pool(
        settings.database_url.get_secret_value(),
        min_size=1,
        max_size=2,
        statement_cache_size=settings.database_statement_cache_size,
    )
    try:

        async def done() -> bool:
            return settled(await progress(pool, f"{prefix}-%"), n, lookup=False)

        await wait_for(done, timeout_s, f"{n} operations {prefix}-* final and the outbox drained")
    finally:
        await pool.close()


async def report_of(settings: Settings, prefix: str, ids: list[str]) -> dict[str, Any]:
    pool = await create_pool(
        settings.database_url.get_secret_value(),
        min_size=1,
        max_size=2,
        statement_cache_size=settings.database_statement_cache_size,
    )
    try:
        return await collect_report(settings, pool, f"{prefix}-%", ids, {})
    finally:
        await pool.close()


async def main_flow_through_the_cli(settings: Settings, tmp_path: Path, n: int = 12) -> dict[str, Any]:
    """``streams migrate`` and ``ready``, one worker, ``streams submit`` of ``n`` operations, ``streams follow``
    of their outputs, ``streams operations list``/``show``, ``streams accounting report``, ``streams dead-letters
    list`` and the live view's Kafka figures; returns the report."""
    checked(streams_cli(settings, "migrate"))
    assert "not ready" not in checked(streams_cli(settings, "ready", "--timeout-s", "60"))
    fleet = Fleet(settings, tmp_path)
    prefix = f"cli{uuid.uuid4().hex[:8]}"
    try:
        fleet.start()
        await fleet.wait_ready()
        lines = [{"operation_id": f"{prefix}-{i:05d}", "request": provider_request(40, 4)} for i in range(n)]
        path = tmp_path / "submissions.jsonl"
        path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
        checked(streams_cli(settings, "submit", str(path)))
        await wait_settled(settings, prefix, n)
        report = await report_of(settings, prefix, [str(line["operation_id"]) for line in lines])
        outputs = report["outputs_expected"]
        followed = checked(
            streams_cli(settings, "follow", "--count", str(outputs), "--operation-prefix", prefix, timeout_s=60)
        )
        assert len(followed.splitlines()) == outputs > 0
        assert {orjson.loads(x)["operation_id"] for x in followed.splitlines()} <= {
            line["operation_id"] for line in lines
        }
        listed = checked(streams_cli(settings, "operations", "list"))
        assert f"{prefix}-00000" in listed or "succeeded" in listed
        shown = checked(streams_cli(settings, "operations", "show", f"{prefix}-00000"))
        assert f"{prefix}-00000" in shown
        checked(streams_cli(settings, "accounting", "report"))
        # the dead letters and the live view's Kafka figures over the same security settings (they once spoke
        # PLAINTEXT to every broker)
        assert orjson.loads(checked(streams_cli(settings, "dead-letters", "list", "--json")))["dead_letters"] == []
        figures = KafkaFigures(settings)
        try:
            lag, dead_letters = await asyncio.wait_for(figures.read(), 60)
        finally:
            await figures.close()
        assert set(lag) == {settings.topic(role) for role in CONSUMED_ROLES}
        assert dead_letters["retained"] == 0
        return report
    finally:
        fleet.stop_all()
        await delete_topics(settings)


def sasl_ssl(prod: dict[str, str]) -> dict[str, Any]:
    return {
        "kafka_bootstrap": prod["kafka-secure.sasl_ssl.bootstrap"],
        "kafka_security_protocol": "SASL_SSL",
        "kafka_sasl_mechanism": "SCRAM-SHA-512",
        "kafka_sasl_username": prod["kafka-secure.user"],
        "kafka_sasl_password": prod["kafka-secure.password"],
        "kafka_ssl_ca_file": prod["tls.ca"],
    }


def mutual_tls(prod: dict[str, str]) -> dict[str, Any]:
    return {
        "kafka_bootstrap": prod["kafka-secure.mtls.bootstrap"],
        "kafka_security_protocol": "SSL",
        "kafka_ssl_ca_file": prod["tls.ca"],
        "kafka_ssl_cert_file": prod["tls.client_cert"],
        "kafka_ssl_key_file": prod["tls.client_key"],
    }


def redis_tls(prod: dict[str, str]) -> dict[str, Any]:
    """Redis over TLS as the ACL user (its keys restricted to ``app:*``: the product's own prefix)."""
    return {"redis_url": prod["redis-tls.url"], "redis_ssl_ca_file": prod["tls.ca"], "lease_key_prefix": "app"}


def through_pgbouncer(prod: dict[str, str], base: Settings) -> dict[str, Any]:
    """The test database through PgBouncer (transaction pooling), without asyncpg's statement cache."""
    database = base.database_url.get_secret_value().rsplit("/", 1)[1].split("?")[0]
    url = prod["pgbouncer.url"].rsplit("/", 1)[0] + f"/{database}"
    return {"database_url": url, "database_statement_cache_size": 0}


@pytest.mark.parametrize("kafka", ["sasl_ssl", "mutual_tls"])
async def test_the_main_flow_over_a_secured_broker(
    base_settings: Settings, sim: SimulatorServer, tmp_path: Path, kafka: str
) -> None:
    prod = prod_config("kafka-secure")
    security = sasl_ssl(prod) if kafka == "sasl_ssl" else mutual_tls(prod)
    report = await main_flow_through_the_cli(flow_settings(base_settings, sim, **security), tmp_path)
    assert_promises(report, 12)


async def test_the_main_flow_with_redis_over_tls_as_a_restricted_acl_user(
    base_settings: Settings, sim: SimulatorServer, tmp_path: Path
) -> None:
    prod = prod_config("redis-tls")
    assert prod["redis-tls.key_patterns"] == "app:*" and prod["redis-tls.default_user"] == "off"
    # the lease, the rate budget and the operators' lease reads all run as this user; anything else is refused
    report = await main_flow_through_the_cli(flow_settings(base_settings, sim, **redis_tls(prod)), tmp_path)
    assert_promises(report, 12)
    settings = flow_settings(base_settings, sim, **redis_tls(prod))
    from streams.coordination.lease import redis_for

    client = redis_for(settings, 2.0)
    try:
        with pytest.raises(NoPermissionError, match="no permissions to access one of the keys"):
            await client.set("other:key", "x")
        with pytest.raises(NoPermissionError, match="has no permissions to run the 'flushall' command"):
            await client.flushall()
    finally:
        await client.aclose()


async def test_the_main_flow_and_the_relay_lock_through_pgbouncer_in_transaction_mode(
    base_settings: Settings, sim: SimulatorServer, tmp_path: Path
) -> None:
    prod = prod_config("pgbouncer")
    assert prod["pgbouncer.pool_mode"] == "transaction"
    settings = flow_settings(base_settings, sim)
    checked(streams_cli(settings, "migrate"))  # against PostgreSQL itself: yoyo holds a lock across statements
    bounced = settings.replace(**through_pgbouncer(prod, base_settings))
    fleet = Fleet(bounced, tmp_path)
    prefix = f"pgb{uuid.uuid4().hex[:8]}"
    try:
        fleet.start()
        fleet.start()  # two relays: the transaction-scoped advisory lock lets one publish at a time
        await fleet.wait_ready()
        ids = await submit_steadily(bounced, prefix, 60, 30.0)
        await wait_settled(bounced, prefix, 60)
        report = await report_of(bounced, prefix, ids)
    finally:
        fleet.stop_all()
        await delete_topics(settings)
    assert_promises(report, 60)
    assert report["output_duplicates"] == 0  # one publisher at a time: no event sent twice by two relays
    for args in (["operations", "list"], ["operations", "show", ids[0]], ["accounting", "report"]):
        checked(streams_cli(bounced.replace(lease_key_prefix=settings.lease_key_prefix), *args))


async def test_a_sentinel_failover_under_load(base_settings: Settings, sim: SimulatorServer, tmp_path: Path) -> None:
    prod = prod_config("redis-sentinel")
    settings = flow_settings(
        base_settings,
        sim,
        redis_sentinels=prod["redis-sentinel.sentinels"],
        redis_sentinel_master=prod["redis-sentinel.master_name"],
    )
    checked(streams_cli(settings, "migrate"))
    fleet = Fleet(settings, tmp_path)
    prefix = f"sen{uuid.uuid4().hex[:8]}"
    n = 200
    try:
        fleet.start()
        fleet.start()
        await fleet.wait_ready()
        sent: list[str] = []
        load = asyncio.create_task(submit_steadily(settings, prefix, n, 10.0, sent))
        await wait_for(lambda: _true(len(sent) >= n // 3), 60, "a third of the load submitted")
        t0, failover_ms = time.monotonic(), _now_ms()
        failover = await asyncio.to_thread(prod_services, "failover")
        assert failover.returncode == 0, failover.stderr
        print(f"\nsentinel failover: {time.monotonic() - t0:.1f} s ({failover.stdout.strip()})")
        ids = await load
        await wait_settled(settings, prefix, n)
        report = await report_of(settings, prefix, ids)
        times = await ledger_times(settings, prefix)
        costs = {
            name: sum([await metric_total(w, name) for w in fleet.live()])
            for name in ("streams_lease_lost_total", "streams_fencing_refusals_total")
        }
    finally:
        fleet.stop_all()
        await delete_topics(settings)
    finals = [f for _, _, f in times if f is not None]
    stall_s = longest_gap_s(finals, failover_ms, max(finals, default=failover_ms))
    print(
        f"sentinel failover cost: max GETs in flight per job {report['max_gets_in_flight_per_job']}, {costs},"
        f" longest time without an operation reaching a final state {stall_s:.1f} s"
    )
    assert_promises(report, n)


async def _true(value: bool) -> bool:
    return value


async def metric_total(worker: Worker, name: str) -> float:
    """The sum of every sample ``name`` (all labels) in the worker's ``/metrics``."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        answer = await client.get(f"{worker.url}/metrics")
    answer.raise_for_status()
    return sum(s.value for f in text_string_to_metric_families(answer.text) for s in f.samples if s.name == name)


# --------------------------------------------------------------------------- the 3-broker cluster


def partition_of(key: str, partitions: int) -> int:
    """The partition aiokafka's default partitioner gives ``key`` (murmur2, as Kafka's Java client)."""
    return int(murmur2(key.encode()) & 0x7FFFFFFF) % partitions


async def ledger_times(settings: Settings, prefix: str) -> list[tuple[str, int, int | None]]:
    """(operation id, accepted_at_ms, final_at_ms) of the operations ``<prefix>-*``."""
    from streams_harness.report import REPORT

    pool = await create_pool(
        settings.database_url.get_secret_value(),
        min_size=1,
        max_size=2,
        statement_cache_size=settings.database_statement_cache_size,
    )
    try:
        rows = await REPORT.run_operations.fetch(pool, operation_pattern=f"{prefix}-%")
    finally:
        await pool.close()
    return [(r["operation_id"], r["accepted_at_ms"], r["final_at_ms"]) for r in rows]


def longest_stall_s(
    times: list[tuple[str, int, int | None]],
    partitions: int,
    since_ms: int,
    until_ms: int,
    only: list[int] | None = None,
) -> tuple[float, int]:
    """The longest time, within ``since_ms .. until_ms``, a submissions partition (of ``only``, default all) went
    without an operation reaching a final state, and that partition (operations on every partition arrive
    steadily meanwhile)."""
    by_partition: dict[int, list[int]] = {}
    for operation_id, _, final_ms in times:
        if final_ms is not None:
            by_partition.setdefault(partition_of(operation_id, partitions), []).append(final_ms)
    return max(
        (
            (longest_gap_s(by_partition.get(p, []), since_ms, until_ms), p)
            for p in (range(partitions) if only is None else only)
        ),
        default=(0.0, -1),
    )


async def run_kafka_tool_leaders(topic: str) -> str:
    result = await asyncio.to_thread(prod_services, "leaders", topic)
    assert result.returncode == 0, result.stderr
    return result.stdout


def most_common_leader(leaders_text: str) -> int:
    """The broker that leads most partitions in ``scripts/prod-services leaders`` output."""
    counts: dict[int, int] = {}
    for leader in re.findall(r": leader (\d+) ", leaders_text):
        counts[int(leader)] = counts.get(int(leader), 0) + 1
    assert counts, leaders_text
    return max(counts, key=lambda b: counts[b])


def coordinator_of(group: str) -> int:
    result = prod_services("coordinator", group)
    assert result.returncode == 0, result.stderr
    found = re.search(r"coordinator node (\d+)", result.stdout)
    assert found, result.stdout
    return int(found.group(1))


def cluster_settings(base: Settings, sim: SimulatorServer, prod: dict[str, str], **changes: Any) -> Settings:
    return flow_settings(
        base,
        sim,
        kafka_bootstrap=prod["kafka-cluster.bootstrap"],
        kafka_replication_factor=3,
        kafka_min_insync_replicas=2,
        kafka_metadata_max_age_s=5.0,
        partitions=8,
        **changes,
    )


@pytest.fixture
async def cluster(base_settings: Settings, sim: SimulatorServer) -> AsyncIterator[tuple[Settings, dict[str, str]]]:
    prod = prod_config("kafka-cluster")
    settings = cluster_settings(base_settings, sim, prod)
    yield settings, prod
    for n in (1, 2, 3):  # whatever a test stopped comes back for the next one
        await asyncio.to_thread(prod_services, "start-broker", str(n))
    await delete_topics(settings)


async def test_migrate_creates_the_topics_with_rf_3_and_min_isr_2(cluster: tuple[Settings, dict[str, str]]) -> None:
    settings, _ = cluster
    checked(streams_cli(settings, "migrate", "--strict-topics"))
    async with KafkaAdmin(settings) as admin:
        layouts = await admin.topic_layouts(list(settings.topics.values()))
    assert {(n, lay.partitions, lay.replication_factor, lay.min_insync_replicas) for n, lay in layouts.items()} == {
        (name, settings.partitions, 3, 2) for name in settings.topics.values()
    }


async def test_broker_kills_under_load_cost_a_bounded_stall_and_break_no_promise(
    cluster: tuple[Settings, dict[str, str]], tmp_path: Path
) -> None:
    settings, _ = cluster
    checked(streams_cli(settings, "migrate"))
    fleet = Fleet(settings, tmp_path)
    prefix = f"kil{uuid.uuid4().hex[:8]}"
    n, rate = 400, 5.0
    events: list[tuple[str, int]] = []
    try:
        for _ in range(2):
            fleet.start()
        await fleet.wait_ready()
        sent: list[str] = []
        load = asyncio.create_task(submit_steadily(settings, prefix, n, rate, sent))

        async def after(count: int) -> None:
            await wait_for(lambda: _true(len(sent) >= count or load.done()), 120, f"{count} submissions sent")

        await after(60)
        leader = most_common_leader(await run_kafka_tool_leaders(settings.topic("submissions")))
        events.append((f"kill -9 broker {leader} (leader of most submission partitions)", _now_ms()))
        assert (await asyncio.to_thread(prod_services, "kill-broker", str(leader))).returncode == 0
        await after(160)
        assert (await asyncio.to_thread(prod_services, "start-broker", str(leader))).returncode == 0
        await after(200)
        coordinator = await asyncio.to_thread(coordinator_of, settings.app_id)
        events.append((f"kill -9 broker {coordinator} (the group coordinator)", _now_ms()))
        assert (await asyncio.to_thread(prod_services, "kill-broker", str(coordinator))).returncode == 0
        await after(280)
        assert (await asyncio.to_thread(prod_services, "start-broker", str(coordinator))).returncode == 0
        await after(300)
        victim = most_common_leader(await run_kafka_tool_leaders(settings.topic("submissions")))
        events.append((f"stop broker {victim} for good", _now_ms()))
        assert (await asyncio.to_thread(prod_services, "stop-broker", str(victim))).returncode == 0
        ids = await load
        await wait_settled(settings, prefix, n)
        report = await report_of(settings, prefix, ids)
        times = await ledger_times(settings, prefix)
    finally:
        fleet.stop_all()
    ends = [t for _, t in events[1:]] + [max(f or 0 for _, _, f in times) if times else _now_ms()]
    print()
    for (what, at_ms), until_ms in zip(events, ends, strict=True):
        stall_s, partition = longest_stall_s(times, settings.partitions, at_ms, until_ms)
        print(f"{what}: longest stall of a submissions partition {stall_s:.1f} s (partition {partition})")
    assert_promises(report, n)


#: How long the test's SIGSTOP lasts, and the longest stall it may cost (docs/production-services.md has the
#: measured figures; the bounds are them with margin): no operation reaching a final state in the ledger on a
#: healthy partition (one whose submissions and polls partitions, the two an operation is read from, the frozen
#: broker did not lead), on any partition, and no outbox row published. A healthy partition's operations still
#: arrive at about 0.6/s, so its gaps of 8 s and more happen without any fault; one run of three stalled a healthy
#: partition 25.5 s (not explained yet; likely the consumer's metadata, below). The frozen broker's partitions
#: wait for the consumer's metadata (its request to the frozen broker is answered only at the resume) and for the
#: relay's and the scheduler's next probe of a blocked partition (skips of 10 s doubling after each failed probe).
PAUSE_S = 30.0
PAUSE_STALL_BOUNDS_S = {"healthy partitions": PAUSE_S + 10.0, "any partition": PAUSE_S + 25.0, "publications": 20.0}


async def test_a_paused_broker_under_load_costs_a_bounded_stall_and_breaks_no_promise(
    cluster: tuple[Settings, dict[str, str]], tmp_path: Path
) -> None:
    """SIGSTOP (a GC pause, a VM freeze: its connections stay open, unanswered, until the controllers fence it
    after broker.session.timeout.ms) of the broker leading most submission partitions for ``PAUSE_S``, then SIGCONT,
    under 300 submissions at 5/s."""
    settings, _ = cluster
    checked(streams_cli(settings, "migrate"))
    fleet = Fleet(settings, tmp_path)
    prefix = f"pau{uuid.uuid4().hex[:8]}"
    n, rate = 300, 5.0
    try:
        for _ in range(2):
            fleet.start()
        await fleet.wait_ready()
        sent: list[str] = []
        load = asyncio.create_task(submit_steadily(settings, prefix, n, rate, sent))

        async def after(count: int) -> None:
            await wait_for(lambda: _true(len(sent) >= count or load.done()), 120, f"{count} submissions sent")

        await after(60)
        leaders_text = await run_kafka_tool_leaders(settings.topic("submissions"))
        leaders, paused = partition_leaders(leaders_text), most_common_leader(leaders_text)
        poll_leaders = partition_leaders(await run_kafka_tool_leaders(settings.topic("polls")))
        coordinator = await asyncio.to_thread(coordinator_of, settings.app_id)
        healthy = sorted(p for p, leader in leaders.items() if paused not in (leader, poll_leaders[p]))
        paused_ms = _now_ms()
        assert (await asyncio.to_thread(prod_services, "pause-broker", str(paused))).returncode == 0
        await asyncio.sleep(PAUSE_S)  # the fault's length (not a wait for an outcome); the load goes on meanwhile
        resumed_ms = _now_ms()
        resume = await asyncio.to_thread(prod_services, "resume-broker", str(paused))
        assert resume.returncode == 0, resume.stderr
        ids = await load
        await wait_settled(settings, prefix, n)
        report = await report_of(settings, prefix, ids)
        times = await ledger_times(settings, prefix)
        published = await publication_times(settings, prefix)
    finally:
        fleet.stop_all()  # the fixture's start-broker resumes a broker left paused
    until_ms = max(f or 0 for _, _, f in times)
    stalls = {
        "healthy partitions": longest_stall_s(times, settings.partitions, paused_ms, until_ms, only=healthy)[0],
        "any partition": longest_stall_s(times, settings.partitions, paused_ms, until_ms)[0],
        "publications": longest_gap_s(published, paused_ms, max(published, default=until_ms)),
    }
    led = sum(leader == paused for leader in leaders.values())
    print(
        f"\nSIGSTOP broker {paused} (leader of {led} of {len(leaders)} submission partitions; healthy {healthy})"
        f"{', the group coordinator,' if coordinator == paused else ''} for {(resumed_ms - paused_ms) / 1000:.1f} s:"
        " longest stall "
        + ", ".join(f"{what} {stall_s:.1f} s" for what, stall_s in stalls.items())
        + f"; resume-broker: {resume.stdout.strip().splitlines()[-1]}"
    )
    assert_promises(report, n)
    assert {w: s <= PAUSE_STALL_BOUNDS_S[w] for w, s in stalls.items()} == dict.fromkeys(stalls, True), stalls


def partition_leaders(leaders_text: str) -> dict[int, int]:
    """Partition -> leader broker in ``scripts/prod-services leaders`` output."""
    found = {int(p): int(b) for p, b in re.findall(r"partition (\d+): leader (\d+) ", leaders_text)}
    assert found, leaders_text
    return found


async def publication_times(settings: Settings, prefix: str) -> list[int]:
    """The publication times (ms) of the outbox rows of the operations ``<prefix>-*``, in order."""
    pool = await create_pool(
        settings.database_url.get_secret_value(),
        min_size=1,
        max_size=2,
        statement_cache_size=settings.database_statement_cache_size,
    )
    try:
        return await publication_times_ms(pool, f"{prefix}-%")
    finally:
        await pool.close()


def longest_gap_s(marks_ms: list[int], since_ms: int, until_ms: int) -> float:
    """The longest time within ``since_ms .. until_ms`` between two of ``marks_ms`` (or a mark and an end)."""
    marks = sorted([since_ms, *(m for m in marks_ms if since_ms <= m <= until_ms), until_ms])
    return max(b - a for a, b in itertools.pairwise(marks)) / 1000.0


def _now_ms() -> int:
    return int(time.time() * 1000)


async def test_partitions_grown_live_are_read_within_the_metadata_age(
    cluster: tuple[Settings, dict[str, str]], tmp_path: Path
) -> None:
    settings, _ = cluster
    assert settings.partitions == 8
    checked(streams_cli(settings, "migrate"))
    fleet = Fleet(settings, tmp_path)
    prefix = f"gro{uuid.uuid4().hex[:8]}"
    try:
        fleet.start()
        fleet.start()
        await fleet.wait_ready()
        before = await submit_steadily(settings, f"{prefix}a", 40, 20.0)
        await wait_settled(settings, f"{prefix}a", 40)
        async with KafkaAdmin(settings) as admin:
            await _grow(admin, [settings.topic("submissions"), settings.topic("polls")], 16)
        grown = settings.replace(partitions=16)
        t0 = time.monotonic()
        # the producer of a fresh process reads 16 partitions: keys that now hash to 8..15 land there
        after = await submit_steadily(grown, f"{prefix}b", 120, 40.0)
        on_new = [i for i in after if partition_of(i, 16) >= 8]
        assert len(on_new) > 30
        await wait_settled(grown, f"{prefix}b", 120, timeout_s=settings.kafka_metadata_max_age_s + 60)
        took_s = time.monotonic() - t0
        times = {op: (acc, fin) for op, acc, fin in await ledger_times(grown, f"{prefix}b")}
        late = max((times[i][1] or 0) - times[i][0] for i in on_new) / 1000.0
        report = await report_of(grown, f"{prefix}b", after)
    finally:
        fleet.stop_all()
    print(f"\npartitions 8 -> 16: 120 submissions final in {took_s:.1f} s; slowest on a new partition {late:.1f} s")
    assert_promises(report, 120)
    assert len(before) == 40
    # handled within the metadata age (the consumer's refresh finds the new partitions) plus a rebalance
    assert late <= settings.kafka_metadata_max_age_s + settings.kafka_session_timeout_s + 5.0


async def _grow(admin: KafkaAdmin, topics: list[str], partitions: int) -> None:
    from aiokafka.admin import NewPartitions

    async def request(client: Any) -> Any:
        return await client.create_partitions({t: NewPartitions(total_count=partitions) for t in topics})

    await admin.call(f"grow {topics} to {partitions} partitions", request)
