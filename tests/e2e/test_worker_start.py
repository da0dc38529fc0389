"""A worker started while Kafka is away waits for it, and one whose broker went away while Faust was starting
starts again in place, instead of exiting (streams/worker/process.py). Kafka is reached through a Toxiproxy proxy that
the
test disables and enables; the broker itself keeps running."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from streams.clients.submit import SubmissionProducer
from streams.config import Settings
from streams.worker.app import faust_data_dir
from streams_harness import faults
from streams_harness.checkout import checkout_dir
from streams_harness.fleet import Fleet, Worker
from streams_harness.toxiproxy import Toxiproxy
from tests.support import provider_request, wait_for

pytestmark = pytest.mark.e2e

#: How long the test keeps Kafka away from a waiting worker: longer than aiokafka's single bootstrap attempt
#: and the old start-up, which exited within a second of finding the broker gone.
OUTAGE_S = 3.0


@pytest.fixture
async def kafka_proxy(fault_settings: Settings) -> AsyncIterator[tuple[Toxiproxy, str, int]]:
    """A Toxiproxy proxy in front of the broker: (client, proxy name, port)."""
    Toxiproxy.ensure_running()
    toxi = Toxiproxy()
    name = f"kafka-{uuid.uuid4().hex[:6]}"
    port = await toxi.create(name, fault_settings.kafka_bootstrap.split(",")[0])
    yield toxi, name, port
    await toxi.delete(name)


async def _succeeds(producer: SubmissionProducer, pool: asyncpg.Pool, operation_id: str) -> None:
    await (await producer.submit(operation_id, provider_request(10, 5)))

    async def done() -> bool:
        state = await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = $1", operation_id)
        return bool(state == "succeeded")

    await wait_for(done, 60, f"{operation_id} to succeed")


async def paused_when_ready(fleet: Fleet, tmp_path: Path) -> Worker:
    """Start worker ``a`` of ``fleet`` armed to stop itself (SIGSTOP) once it found the services ready, before
    Faust starts its clients; return it stopped there."""
    hook = tmp_path / "pause-when-ready"
    hook.touch()
    worker = fleet.start("a", faults={faults.PAUSE_WHEN_READY_FILE: str(hook)})

    async def paused() -> bool:
        return worker.stopped()

    await wait_for(paused, 60, "the worker to pause with the services ready")
    return worker


async def test_a_worker_started_while_kafka_is_away_waits_for_it(
    fault_settings: Settings,
    tmp_path: Path,
    kafka_proxy: tuple[Toxiproxy, str, int],
    producer: SubmissionProducer,
    ledger_pool: asyncpg.Pool,
) -> None:
    toxi, name, port = kafka_proxy
    await toxi.enable(name, False)
    fleet = Fleet(fault_settings.replace(kafka_bootstrap=f"127.0.0.1:{port}"), tmp_path)
    try:
        worker = fleet.start("a")

        async def waiting() -> bool:
            return "waiting for postgres, redis, kafka" in worker.log_text()

        await wait_for(waiting, 60, "the worker to wait for the services")
        await asyncio.sleep(OUTAGE_S)  # the outage's length, not a wait for a condition
        assert worker.alive(), worker.log_text()[-3000:]
        assert "services ready" not in worker.log_text()
        await toxi.enable(name, True)
        await fleet.wait_ready("a")
        await _succeeds(producer, ledger_pool, f"wait{uuid.uuid4().hex[:6]}")
        assert worker.alive() and "starting again" not in worker.log_text()
        # Faust's data directory goes to the temporary directory, not the worker's working directory (the
        # checkout: every worker of the tests and the benchmark would leave one there).
        app_id = fault_settings.app_id
        assert faust_data_dir(app_id).is_dir() and not (checkout_dir() / f"{app_id}-data").exists()
    finally:
        fleet.stop_all()


async def test_a_broker_gone_while_faust_starts_starts_the_worker_again(
    fault_settings: Settings,
    tmp_path: Path,
    kafka_proxy: tuple[Toxiproxy, str, int],
    producer: SubmissionProducer,
    ledger_pool: asyncpg.Pool,
) -> None:
    toxi, name, port = kafka_proxy
    fleet = Fleet(fault_settings.replace(kafka_bootstrap=f"127.0.0.1:{port}"), tmp_path)
    try:
        worker = await paused_when_ready(fleet, tmp_path)
        pid = worker.pid
        await toxi.enable(name, False)  # the broker goes away between the check and Faust's own clients
        worker.signal(signal.SIGCONT)

        async def restarted() -> bool:
            return "starting again (attempt 2 of 5)" in worker.log_text()

        await wait_for(restarted, 60, "the worker to start again")
        await toxi.enable(name, True)
        await fleet.wait_ready("a")
        assert worker.alive() and worker.pid == pid  # the same process, started again in place
        log = worker.log_text()
        assert "KafkaConnectionError" in log and log.count("services ready after") == 2
        await _succeeds(producer, ledger_pool, f"again{uuid.uuid4().hex[:6]}")
    finally:
        fleet.stop_all()


async def test_postgres_gone_while_faust_starts_is_waited_for_in_place(
    fault_settings: Settings, tmp_path: Path, producer: SubmissionProducer, ledger_pool: asyncpg.Pool
) -> None:
    """PostgreSQL is first needed by the agents, after Faust started: its absence there is waited out in the
    process (no exit, no second start)."""
    Toxiproxy.ensure_running()
    toxi = Toxiproxy()
    name = f"pg-{uuid.uuid4().hex[:6]}"
    url = urlsplit(fault_settings.database_url.get_secret_value())
    port = await toxi.create(name, f"{url.hostname}:{url.port or 5432}")
    proxied = urlunsplit(url._replace(netloc=url.netloc.replace(f"{url.hostname}:{url.port}", f"127.0.0.1:{port}")))
    fleet = Fleet(fault_settings.replace(database_url=proxied), tmp_path)
    try:
        worker = await paused_when_ready(fleet, tmp_path)
        await toxi.enable(name, False)
        worker.signal(signal.SIGCONT)

        async def waiting() -> bool:
            return "PostgreSQL unavailable while the worker starts" in worker.log_text()

        await wait_for(waiting, 60, "the worker to wait for PostgreSQL")
        assert worker.alive()
        await toxi.enable(name, True)
        await _succeeds(producer, ledger_pool, f"pg{uuid.uuid4().hex[:6]}")
        assert worker.alive() and "starting again" not in worker.log_text()
    finally:
        fleet.stop_all()
        await toxi.delete(name)


async def test_a_worker_told_to_stop_while_faust_starts_stops_instead_of_starting_again(
    fault_settings: Settings, tmp_path: Path, kafka_proxy: tuple[Toxiproxy, str, int]
) -> None:
    """SIGTERM while Faust's clients wait for a broker that then goes away: the process stops (the supervisor asked
    it to), it does not start again in place and carry on as if nobody had asked."""
    toxi, name, port = kafka_proxy
    fleet = Fleet(fault_settings.replace(kafka_bootstrap=f"127.0.0.1:{port}"), tmp_path)
    try:
        worker = await paused_when_ready(fleet, tmp_path)
        await toxi.blackhole(name, True)  # Faust's clients connect, and wait for answers that do not come
        worker.signal(signal.SIGCONT)

        async def faust_starting() -> bool:
            return "Producer]: Starting" in worker.log_text() or "Consumer]: Starting" in worker.log_text()

        await wait_for(faust_starting, 60, "Faust to start its clients")
        worker.signal(signal.SIGTERM)
        await toxi.enable(name, False)  # the broker goes away: the clients' start fails with an outage

        async def exited() -> bool:
            return not worker.alive()

        await wait_for(exited, 60, "the worker to stop on SIGTERM")
        assert "starting again" not in worker.log_text()
    finally:
        fleet.stop_all()


async def test_a_worker_crashed_by_an_outage_after_it_started_starts_again_in_place(
    fault_settings: Settings, tmp_path: Path, producer: SubmissionProducer, ledger_pool: asyncpg.Pool
) -> None:
    """Faust stops the whole worker when one of its services crashes; a broker outage crashed its Conductor (a
    CreateTopics call in its first subscription, during a broker restart: NodeNotReadyError, exit 1 in a soak).
    The crash hook crashes the Conductor the same way after the worker started."""
    hook = tmp_path / "crash-after-start"
    hook.write_text("outage")
    fleet = Fleet(fault_settings, tmp_path)
    try:
        worker = fleet.start("a", faults={faults.CRASH_AFTER_START_FILE: str(hook)})
        pid = worker.pid

        async def restarted() -> bool:
            return "and crashed this worker (NodeNotReadyError" in worker.log_text()

        await wait_for(restarted, 60, "the crashed worker to start again")
        assert "starting again (attempt 2 of 5)" in worker.log_text()

        async def started_twice() -> bool:
            return worker.log_text().count("services ready after") == 2

        await wait_for(started_twice, 60, "the worker's second start")
        await fleet.wait_ready("a")
        assert worker.alive() and worker.pid == pid
        await _succeeds(producer, ledger_pool, f"crash{uuid.uuid4().hex[:6]}")
    finally:
        fleet.stop_all()


async def test_a_worker_crashed_by_a_bug_after_it_started_exits(fault_settings: Settings, tmp_path: Path) -> None:
    hook = tmp_path / "crash-after-start"
    hook.write_text("bug")
    fleet = Fleet(fault_settings, tmp_path)
    try:
        worker = fleet.start("a", faults={faults.CRASH_AFTER_START_FILE: str(hook)})

        async def exited() -> bool:
            return not worker.alive()

        await wait_for(exited, 60, "the worker crashed by a bug to exit")
        assert worker.proc.returncode == 1
        log = worker.log_text()
        assert "fault hook: a bug in a Faust service" in log and "starting again" not in log
    finally:
        fleet.stop_all()
