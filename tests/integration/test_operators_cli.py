"""The operators' read commands as a person runs them: the ``streams`` script in a subprocess, on the real ledger
(PostgreSQL) and leases (Redis), against figures read back with SQL."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from streams.config import Settings, lease_key
from streams.coordination.lease import LeaseManager, make_redis
from streams.ledger.store import Ledger
from tests.integration.operators_support import HOSTILE_REASON, Seeded, backdate, seed_ledger, streams_cli

pytestmark = pytest.mark.integration


@pytest.fixture
def cli_settings(migrated: Settings) -> Settings:
    return migrated.replace(lease_key_prefix=f"t{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def seeded(pool: asyncpg.Pool) -> Seeded:
    return await seed_ledger(Ledger(pool, "seed-worker"), "cli")


@pytest.fixture
async def leases(cli_settings: Settings) -> AsyncIterator[LeaseManager]:
    client = make_redis(cli_settings.redis_url.get_secret_value(), cli_settings.redis_socket_timeout_s)
    yield LeaseManager(client, 30_000)
    await client.aclose()


async def test_list_all_then_by_state(cli_settings: Settings, pool: asyncpg.Pool, seeded: Seeded) -> None:
    everything = (await streams_cli(cli_settings, "operations", "list", "--json")).json()
    rows = await pool.fetch("SELECT operation_id, state::text AS state, fencing_token, remote_job_id FROM operations")
    assert everything["matched"] == len(rows) == 11
    expected = {r["operation_id"]: (r["state"], r["fencing_token"], r["remote_job_id"]) for r in rows}
    listed = {o["operation_id"]: (o["state"], o["fencing_token"], o["remote_job_id"]) for o in everything["operations"]}
    assert listed == expected

    uncertain = (await streams_cli(cli_settings, "operations", "list", "--state", "uncertain", "--json")).json()
    assert [o["operation_id"] for o in uncertain["operations"]] == seeded.by_state["uncertain"]  # oldest first
    assert uncertain["operations"][0]["reason"] == HOSTILE_REASON
    assert {o["reason_code"] for o in uncertain["operations"]} == {"unknown_outcome"}
    assert all(0 <= o["state_age_s"] < 60 for o in uncertain["operations"])

    two = await streams_cli(cli_settings, "operations", "list", "--state", "rejected", "--state", "failed", "--json")
    assert {o["state"] for o in two.json()["operations"]} == {"rejected", "failed"} and two.json()["matched"] == 2

    text = await streams_cli(cli_settings, "operations", "list", "--state", "submitted")
    header, *lines = text.stdout.splitlines()
    assert header.split() == ["OPERATION", "STATE", "AGE", "JOB", "ID", "FENCING", "CODE", "REASON"]
    assert [line.split()[0] for line in lines] == seeded.by_state["submitted"]
    assert [line.split()[3] for line in lines] == [seeded.job_ids[op] for op in seeded.by_state["submitted"]]


async def test_list_older_than_and_limit(cli_settings: Settings, pool: asyncpg.Pool, seeded: Seeded) -> None:
    old = seeded.by_state["uncertain"][1]
    await backdate(pool, old, "2 hours 5 minutes")
    older = await streams_cli(cli_settings, "operations", "list", "--state", "uncertain", "--older-than", "2h")
    _header, line = older.stdout.splitlines()
    assert line.split()[:3] == [old, "uncertain", "2h05m"]
    as_json = (await streams_cli(cli_settings, "operations", "list", "--older-than", "1h30m", "--json")).json()
    assert [o["operation_id"] for o in as_json["operations"]] == [old] and 7500 <= as_json["operations"][0][
        "state_age_s"
    ]
    assert (await streams_cli(cli_settings, "operations", "list", "--older-than", "3h", "--json")).json() == {
        "matched": 0,
        "operations": [],
    }

    limited = await streams_cli(cli_settings, "operations", "list", "--limit", "3")
    assert limited.stdout.splitlines()[1].split()[0] == old  # oldest in its state first
    assert limited.stdout.splitlines()[-1] == "... 8 more (raise --limit)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "5 minutes"], "is not a duration"),
        (["--older-than", "0s"], "is not a positive duration"),
        (["--state", "lost"], "'lost' is not one of"),
        (["--limit", "0"], "0 is not in the range 1<=x<=1000000"),
    ],
)
async def test_list_bad_usage_exits_2(cli_settings: Settings, args: list[str], message: str) -> None:
    result = await streams_cli(cli_settings, "operations", "list", *args)
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""


async def test_show_against_the_ledger(cli_settings: Settings, pool: asyncpg.Pool, seeded: Seeded) -> None:
    op = seeded.by_state["succeeded"][0]
    detail = (await streams_cli(cli_settings, "operations", "show", op, "--json")).json()
    row = await pool.fetchrow(
        "SELECT state::text AS state, fencing_token, remote_job_id FROM operations WHERE operation_id=$1", op
    )
    assert detail["operation"]["operation_id"] == op
    assert (
        detail["operation"]["state"],
        detail["operation"]["fencing_token"],
        detail["operation"]["remote_job_id"],
    ) == (
        row["state"],
        row["fencing_token"],
        row["remote_job_id"],
    )
    transitions = await pool.fetch(
        "SELECT from_state::text AS f, to_state::text AS t, fencing_token, worker FROM transitions "
        "WHERE operation_id=$1 ORDER BY id",
        op,
    )
    assert [(t["from_state"], t["to_state"], t["fencing_token"], t["worker"]) for t in detail["transitions"]] == [
        (t["f"], t["t"], t["fencing_token"], t["worker"]) for t in transitions
    ]
    assert [t["to_state"] for t in detail["transitions"]] == ["accepted", "submitting", "submitted", "succeeded"]
    outbox = await pool.fetch(
        "SELECT output_id, event_id FROM outbox WHERE operation_id=$1 AND output_id IS NOT NULL ORDER BY output_id", op
    )
    assert [(o["output_id"], o["event_id"], o["published_at"]) for o in detail["outputs"]] == [
        (b["output_id"], b["event_id"], None) for b in outbox
    ]
    assert [o["payload"]["text"] for o in detail["outputs"]] == [f"output {i} of {op}" for i in range(2)]
    assert [(c["method"], c["status_code"], c["outcome"]) for c in detail["remote_calls"]] == [
        ("POST", 201, "created"),
        ("GET", 200, "succeeded"),
    ]
    jobs = await pool.fetch("SELECT remote_job_id, learned_via, outcome FROM remote_jobs WHERE operation_id=$1", op)
    assert (
        [(j["remote_job_id"], j["learned_via"], j["outcome"]) for j in detail["remote_jobs"]]
        == [tuple(j.values()) for j in jobs]
        == [(row["remote_job_id"], "post_2xx", "succeeded")]
    )
    assert detail["remote_jobs"][0]["charge"] == {"id": f"ch-{op}", "amount": "0.25", "currency": "USD"}
    assert detail["remote_jobs"][0]["refunds"] == [{"id": f"rf-{op}", "amount": "0.25", "currency": "USD"}]
    assert detail["leases"] == [] and detail["leases_error"] is None

    text = (await streams_cli(cli_settings, "operations", "show", op)).stdout
    assert "state            succeeded (for " in text and f"fencing value    {row['fencing_token']}" in text
    assert "transitions (4)" in text and "outputs (2)" in text and "remote calls (2)" in text
    assert f"output:{op}:out-1" in text and "leases\n  none held" in text
    assert "remote jobs (accounting) (1)" in text and f'{{"id":"rf-{op}","amount":"0.25","currency":"USD"}}' in text


async def test_show_names_the_lease_holder_and_its_ttl(
    cli_settings: Settings, seeded: Seeded, leases: LeaseManager
) -> None:
    op = seeded.by_state["submitted"][0]
    lease = await leases.acquire(lease_key(cli_settings, "observe", op))
    assert lease is not None
    try:
        detail = (await streams_cli(cli_settings, "operations", "show", op, "--json")).json()
        (held,) = detail["leases"]
        assert held["action"] == "observe" and held["key"] == lease.key and held["owner_token"] == lease.token
        assert 0 < held["ttl_ms"] <= 30_000
        text = (await streams_cli(cli_settings, "operations", "show", op)).stdout
        assert f"observe  {lease.key}  {lease.token}" in text
    finally:
        await lease.release()
    after = (await streams_cli(cli_settings, "operations", "show", op, "--json")).json()
    assert after["leases"] == []


async def test_show_unknown_operation_exits_4(cli_settings: Settings, seeded: Seeded) -> None:
    result = await streams_cli(cli_settings, "operations", "show", "no-such-op")
    assert result.exit_code == 4 and result.stdout == ""
    assert "operation 'no-such-op' is not in the ledger" in result.stderr


async def test_redis_down_still_shows_the_ledger(cli_settings: Settings, seeded: Seeded) -> None:
    op = seeded.by_state["uncertain"][0]
    result = await streams_cli(
        cli_settings.replace(redis_url="redis://127.0.0.1:1/0"), "operations", "show", op, "--json"
    )
    assert result.exit_code == 0
    detail = result.json()
    assert detail["operation"]["state"] == "uncertain" and detail["leases"] == []
    assert detail["leases_error"].startswith("Redis unavailable: ")


@pytest.mark.parametrize("args", [["operations", "list"], ["operations", "show", "op-1"]])
async def test_postgres_down_exits_5(cli_settings: Settings, args: list[str]) -> None:
    result = await streams_cli(cli_settings.replace(database_url="postgresql://streams:streams@127.0.0.1:1/x"), *args)
    assert result.exit_code == 5 and "PostgreSQL unavailable" in result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["operations", "--help"], ["list", "show", "Exit statuses", "3 the decision does not apply"]),
        (["operations", "list", "--help"], ["--state", "--older-than", "--limit", "--json"]),
        (["operations", "show", "--help"], ["OPERATION_ID", "leases", "--json"]),
    ],
)
async def test_help(cli_settings: Settings, args: list[str], expected: list[str]) -> None:
    result = await streams_cli(cli_settings, *args)
    assert result.exit_code == 0
    for text in expected:
        assert text in result.stdout


async def test_a_blank_reason_is_refused_by_every_decision_without_a_traceback(
    cli_settings: Settings, pool: asyncpg.Pool, seeded: Seeded
) -> None:
    """``cancel --reason "   "`` reached the ledger's CHECK and ended in a traceback (exit 1)."""
    op = seeded.by_state["accepted"][0]
    for command in ("cancel", "abandon", "fail", "repoll", "forget"):
        result = await streams_cli(cli_settings, "operations", command, op, "--reason", "   ")
        assert result.exit_code == 3, (command, result.stderr)
        assert "Traceback" not in result.stderr and "reason" in result.stderr, (command, result.stderr)
    assert await pool.fetchval("SELECT count(*) FROM cancellations") == 0
