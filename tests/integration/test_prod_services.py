"""The product against the secured services of ``scripts/prod-services`` (kafka-secure, postgres-tls, pgbouncer,
redis-sentinel): what connects, and the one line and exit 6 of each wrong setting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from streams.config import Settings
from streams.ledger.pool import create_pool

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("kafka-secure", "postgres-tls", "pgbouncer", "redis-sentinel")


@pytest.fixture(scope="session")
def prod() -> dict[str, str]:
    """``scripts/prod-services config --show-secrets`` after ``up`` (idempotent) of the services used here."""
    up = subprocess.run([ROOT / "scripts" / "prod-services", "up", *SERVICES], capture_output=True, text=True)
    if up.returncode != 0:
        if os.environ.get("CI"):  # in CI these tests run: .ci/run starts the services first
            pytest.fail(f"scripts/prod-services up failed: {up.stderr[-500:]}")
        pytest.skip(f"scripts/prod-services up failed: {up.stderr[-500:]}")
    out = subprocess.run(
        [ROOT / "scripts" / "prod-services", "config", "--show-secrets"], capture_output=True, text=True, check=True
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def streams(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("STREAMS_") or k.startswith("STREAMS_TEST_")}
    return subprocess.run(
        [sys.executable, "-m", "streams", *args], env={**base, **env}, capture_output=True, text=True, timeout=120
    )


def sasl(prod: dict[str, str], **changes: str) -> dict[str, str]:
    return {
        "STREAMS_KAFKA_BOOTSTRAP": prod["kafka-secure.sasl_ssl.bootstrap"],
        "STREAMS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "STREAMS_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "STREAMS_KAFKA_SASL_USERNAME": prod["kafka-secure.user"],
        "STREAMS_KAFKA_SASL_PASSWORD": prod["kafka-secure.password"],
        "STREAMS_KAFKA_SSL_CA_FILE": prod["tls.ca"],
        **changes,
    }


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"])
def test_ready_over_sasl_ssl(prod: dict[str, str], mechanism: str) -> None:
    result = streams(sasl(prod, STREAMS_KAFKA_SASL_MECHANISM=mechanism), "ready", "--service", "kafka")
    assert result.returncode == 0, result.stderr
    assert "kafka     ready" in result.stdout


def test_ready_over_mutual_tls(prod: dict[str, str]) -> None:
    env = {
        "STREAMS_KAFKA_BOOTSTRAP": prod["kafka-secure.mtls.bootstrap"],
        "STREAMS_KAFKA_SECURITY_PROTOCOL": "SSL",
        "STREAMS_KAFKA_SSL_CA_FILE": prod["tls.ca"],
        "STREAMS_KAFKA_SSL_CERT_FILE": prod["tls.client_cert"],
        "STREAMS_KAFKA_SSL_KEY_FILE": prod["tls.client_key"],
    }
    result = streams(env, "ready", "--service", "kafka")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("change", "line"),
    [
        ({"STREAMS_KAFKA_SASL_PASSWORD": "wrong"}, "the broker refused the SASL login of user 'streams'"),
        ({"STREAMS_KAFKA_SSL_CA_FILE": "untrusted"}, "the broker's certificate is not trusted"),
        ({"plaintext": ""}, "is a TLS listener, but STREAMS_KAFKA_SECURITY_PROTOCOL=PLAINTEXT"),
        ({"STREAMS_KAFKA_SECURITY_PROTOKOL": "SASL_SSL"}, "STREAMS_KAFKA_SECURITY_PROTOKOL is not a setting"),
    ],
)
def test_a_wrong_kafka_setting_is_one_line_and_exit_6(prod: dict[str, str], change: dict[str, str], line: str) -> None:
    env = sasl(prod)
    if "plaintext" in change:
        env = {"STREAMS_KAFKA_BOOTSTRAP": prod["kafka-secure.sasl_ssl.bootstrap"]}
    elif change.get("STREAMS_KAFKA_SSL_CA_FILE") == "untrusted":
        env["STREAMS_KAFKA_SSL_CA_FILE"] = prod["tls.untrusted_ca"]
    else:
        env.update(change)
    result = streams({**env, "STREAMS_KAFKA_ADMIN_DEADLINE_S": "20"}, "ready", "--service", "kafka")
    assert result.returncode == 6, result.stderr
    assert line in result.stderr.strip().splitlines()[-1]
    assert prod["kafka-secure.password"] not in result.stderr


def test_postgres_verify_full_and_its_refusals(prod: dict[str, str]) -> None:
    url = prod["postgres-tls.url"]
    assert streams({"STREAMS_DATABASE_URL": url}, "ready", "--service", "postgres", "--timeout-s", "10").returncode == 0
    missing = url.replace(prod["tls.ca"], "/nonexistent/ca.pem")
    result = streams({"STREAMS_DATABASE_URL": missing}, "ready", "--service", "postgres", "--timeout-s", "10")
    assert result.returncode == 6 and "a TLS file of STREAMS_DATABASE_URL cannot be read" in result.stderr
    no_tls = "postgresql://streams:streams@127.0.0.1:5432/streams?sslmode=require"
    result = streams({"STREAMS_DATABASE_URL": no_tls}, "ready", "--service", "postgres", "--timeout-s", "10")
    assert result.returncode == 6 and "does not offer TLS, but STREAMS_DATABASE_URL asks for it" in result.stderr


async def test_the_ledger_pool_through_pgbouncer_without_a_statement_cache(prod: dict[str, str]) -> None:
    pool = await create_pool(prod["pgbouncer.url"], min_size=1, max_size=2, statement_cache_size=0)
    try:
        for n in range(20):  # with the cache, the second use of a statement names one PgBouncer lost
            assert await pool.fetchval("SELECT $1::int + 1", n) == n + 1
    finally:
        await pool.close()


async def test_pgbouncer_lends_its_server_connections_under_each_clients_application_name(
    prod: dict[str, str],
) -> None:
    """The outbox trigger tells a worker's transitions by the server connection's application_name (migrations
    0019.worker-transitions): PgBouncer in transaction mode sets it on each server connection it lends to a
    client, so a worker's pool and an operator's, sharing the server connections, keep their own names."""
    url = prod["pgbouncer.url"]
    worker = await create_pool(url, min_size=1, max_size=2, statement_cache_size=0, worker=True)
    operator = await create_pool(url, min_size=1, max_size=2, statement_cache_size=0)
    query = "SELECT current_setting('application_name'), pg_backend_pid()"
    try:
        names: dict[str, set[str]] = {"worker": set(), "operator": set()}
        backends: dict[str, set[int]] = {"worker": set(), "operator": set()}
        for _ in range(20):
            for who, pool in (("worker", worker), ("operator", operator)):
                name, pid = await pool.fetchrow(query)
                names[who].add(name)
                backends[who].add(pid)
    finally:
        await worker.close()
        await operator.close()
    assert names == {"worker": {"streams-worker"}, "operator": {"streams"}}
    assert backends["worker"] & backends["operator"]  # the same server connections served both


def test_ready_through_sentinel(prod: dict[str, str]) -> None:
    env = {
        "STREAMS_REDIS_SENTINELS": prod["redis-sentinel.sentinels"],
        "STREAMS_REDIS_SENTINEL_MASTER": prod["redis-sentinel.master_name"],
    }
    result = streams(env, "ready", "--service", "redis")
    assert result.returncode == 0, result.stderr
    assert Settings.from_env(env).redis_sentinel_master == prod["redis-sentinel.master_name"]
