"""Secrets stay secret: a worker process and the main job run with a distinctive API key and a database URL
with a password, and neither appears in any log, report, dead letter or metric."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaProducer

from streams.clients.follow import read_topic_to_end
from streams.clients.submit import SubmissionProducer
from streams.config import Settings
from streams_harness.checkout import checkout_dir
from streams_harness.fleet import Fleet
from streams_harness.mainjob import MainJobOptions, run_main_job
from tests.support import wait_for

pytestmark = pytest.mark.e2e

API_KEY = "sk-test-5f1c0ffee9d2b7a4"

#: The shared role's password is "streams": a URL's password shows as ``:streams@`` wherever it leaks.
PASSWORD_IN_URL = ":streams@"


def assert_no_secret(text: str, where: str) -> None:
    assert API_KEY not in text, f"the API key is in {where}"
    assert PASSWORD_IN_URL not in text, f"the database password is in {where}"


async def test_a_worker_shows_no_secret(fault_settings: Settings, tmp_path: Path) -> None:
    settings = fault_settings.replace(remote_api_key=API_KEY, web_enabled=True)
    assert PASSWORD_IN_URL in settings.database_url.get_secret_value()  # there is a password to hide
    fleet = Fleet(settings, tmp_path)
    worker = fleet.start("w1")
    try:
        await fleet.wait_ready()
        raw = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
        await raw.start()
        try:
            await raw.send_and_wait(settings.topic("submissions"), b"{not json", key=b"bad-1")  # a dead letter
        finally:
            await raw.stop()
        async with SubmissionProducer(settings) as producer:
            op = f"{settings.lease_key_prefix}-ok"
            await (await producer.submit(op, {"input": {"prompt": "p", "max_tokens": 1}}))

        async def dead_lettered() -> bool:
            return bool(await read_topic_to_end(settings, "dead_letter"))

        await wait_for(dead_lettered, 30, "the dead letter")

        async def ready_logged() -> bool:
            return "ready (settings:" in worker.log_text()

        await wait_for(ready_logged, 30, "the worker's settings line")
        async with httpx.AsyncClient(timeout=5) as client:
            metrics = (await client.get(f"http://127.0.0.1:{worker.web_port}/metrics")).text
    finally:
        fleet.stop_all()
    log = worker.log_text()
    assert "database_url=SecretUrl('postgresql://streams:***@127.0.0.1:5432/" in log  # masked, yet readable
    assert "remote_api_key=SecretStr('**********')" in log
    assert_no_secret(log, "the worker's log")
    assert_no_secret(metrics, "the worker's metrics")
    letters = await read_topic_to_end(settings, "dead_letter")
    for letter in letters:
        assert_no_secret(json.dumps(letter.value), "a dead letter")
        assert_no_secret(base64.b64decode(letter.value["original_base64"]).decode(errors="replace"), "a dead letter")


async def test_the_main_job_shows_no_secret(
    base_settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``streams run --rows 100``: its workers, simulator and report see the key only where it is used."""
    monkeypatch.setenv("STREAMS_REMOTE_API_KEY", API_KEY)
    monkeypatch.setenv("STREAMS_DATABASE_URL", base_settings.database_url.get_secret_value())
    out = io.StringIO()
    report = await run_main_job(
        MainJobOptions(rows=100, compression=30.0, workers=1, partitions=2, report_path=tmp_path / "report.json"),
        out=out,
    )
    assert report["operations_final"] == 100, out.getvalue()[-2000:]
    processes_log = (checkout_dir() / "reports" / report["run_id"] / "processes.log").read_text(errors="replace")
    assert "ready (settings:" in processes_log and "remote_api_key=SecretStr('**********')" in processes_log
    assert_no_secret(processes_log, "processes.log")
    assert_no_secret((tmp_path / "report.json").read_text(), "the report")
    assert_no_secret(out.getvalue(), "the main job's output")
