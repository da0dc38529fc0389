"""The operators' decisions and the accounting report through the ``streams`` script, on the real ledger: each
decision is one fenced transition naming who, when and why; any other state is refused with a message and exit
status 3, an unknown operation with 4; nothing but adopt's provider check (tests/integration/test_late_answers.py)
calls the remote API (the simulator counts every request)."""

from __future__ import annotations

import asyncpg
import pytest

from streams.config import Settings
from streams.ledger.records import RemoteCall
from streams.ledger.store import Ledger
from streams.model.codes import RemoteCallOutcome
from tests.integration.operators_support import Seeded, backdate, seed_ledger, streams_cli
from tests.support import SimulatorServer as Simulator

pytestmark = pytest.mark.integration


@pytest.fixture
async def seeded(pool: asyncpg.Pool) -> Seeded:
    return await seed_ledger(Ledger(pool, "seed-worker"), "ops")


@pytest.fixture
def cli(settings: Settings) -> Settings:
    """The test's settings: the simulator as the remote API, so any request would be counted."""
    return settings


async def snapshot(pool: asyncpg.Pool, op: str) -> tuple[object, ...]:
    """What a refused decision must leave untouched: the row and the number of transitions and outbox rows."""
    row = await pool.fetchrow(
        "SELECT state::text, fencing_token, remote_job_id, reason, updated_at, transition_seq FROM operations "
        "WHERE operation_id = $1",
        op,
    )
    assert row is not None
    transitions = await pool.fetchval("SELECT count(*) FROM transitions WHERE operation_id = $1", op)
    outbox = await pool.fetchval("SELECT count(*) FROM outbox WHERE operation_id = $1", op)
    return (*row.values(), transitions, outbox)


async def last_transition(pool: asyncpg.Pool, op: str) -> asyncpg.Record:
    record = await pool.fetchrow(
        "SELECT seq, from_state::text, to_state::text, fencing_token, worker, reason, at FROM transitions "
        "WHERE operation_id = $1 ORDER BY id DESC LIMIT 1",
        op,
    )
    assert record is not None
    return record


async def no_remote_calls(simulator: Simulator) -> None:
    summary = await simulator.get("/_sim/summary")
    assert (summary["posts"], summary["gets"]) == (0, 0)


async def test_adopt_writes_one_fenced_transition_by_the_actor(
    cli: Settings, pool: asyncpg.Pool, seeded: Seeded, simulator: Simulator
) -> None:
    op = seeded.by_state["uncertain"][1]
    before = await pool.fetchval("SELECT fencing_token FROM operations WHERE operation_id = $1", op)
    result = await streams_cli(
        cli,
        "operations",
        "adopt",
        op,
        "job_found_1",
        "--reason",
        "found in the provider's console",
        "--actor",
        "alice",
        "--without-provider-check",
        env={"USER": "dave"},
    )
    assert result.exit_code == 0, result.stderr
    row = await pool.fetchrow(
        "SELECT state::text, remote_job_id, fencing_token FROM operations WHERE operation_id=$1", op
    )
    assert tuple(row.values()) == ("submitted", "job_found_1", before + 1)
    t = await last_transition(pool, op)
    who = "streams@postgres-role/dave@os (given: alice)"  # the test database's login role is streams
    assert (t["seq"], t["from_state"], t["to_state"], t["fencing_token"], t["worker"]) == (
        4,
        "uncertain",
        "submitted",
        before + 1,
        who,
    )
    assert "found in the provider's console" in t["reason"] and "alice" in t["reason"]
    assert "not checked at the provider (--without-provider-check)" in t["reason"]
    assert result.stdout.strip() == (
        f"adopt: operation {op} uncertain -> submitted (transition 4, fencing value {before + 1}), by {who}"
    )
    account = await pool.fetchrow("SELECT learned_via, learned_by FROM remote_jobs WHERE remote_job_id='job_found_1'")
    assert tuple(account.values()) == ("adopted", who)
    await no_remote_calls(simulator)


@pytest.mark.parametrize(
    ("action", "state", "args", "to_state"),
    [
        ("abandon", "uncertain", ["--reason", "no job for the client reference"], "rejected"),
        ("repoll", "stalled", [], "submitted"),
        ("repoll", "stalled", ["--reason", "the provider fixed its status page"], "submitted"),
        ("fail", "stalled", ["--reason", "the provider lost the job"], "failed"),
    ],
)
async def test_decisions_move_their_state_and_print_json(
    cli: Settings,
    pool: asyncpg.Pool,
    seeded: Seeded,
    simulator: Simulator,
    action: str,
    state: str,
    args: list[str],
    to_state: str,
) -> None:
    op = seeded.by_state[state][0]
    before = await pool.fetchval("SELECT fencing_token FROM operations WHERE operation_id = $1", op)
    result = await streams_cli(
        cli, "operations", action, op, *args, "--json", env={"STREAMS_ACTOR": "bob", "USER": "erin"}
    )
    assert result.exit_code == 0, result.stderr
    out = result.json()
    t = await last_transition(pool, op)
    assert out == {
        "operation_id": op,
        "action": action,
        "from_state": state,
        "to_state": to_state,
        "transition_seq": t["seq"],
        "fencing_token": before + 1,
        "actor": "streams@postgres-role/erin@os (given: bob)",
    }
    assert (t["from_state"], t["to_state"], t["fencing_token"], t["worker"]) == (
        state,
        to_state,
        before + 1,
        "streams@postgres-role/erin@os (given: bob)",
    )
    assert await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = $1", op) == to_state
    if args:
        assert args[1] in t["reason"]
    event = await pool.fetchval(
        "SELECT count(*) FROM outbox WHERE event_id = $1", f"transition:{op}:{t['seq']}:{to_state}"
    )
    assert event == 1  # published like every other transition
    await no_remote_calls(simulator)


async def test_actor_defaults_to_the_database_role_and_the_os_user(
    cli: Settings, pool: asyncpg.Pool, seeded: Seeded
) -> None:
    op = seeded.by_state["uncertain"][0]
    result = await streams_cli(
        cli, "operations", "abandon", op, "--reason", "checked", env={"STREAMS_ACTOR": "", "USER": "carol"}
    )
    assert result.exit_code == 0, result.stderr
    who = "streams@postgres-role/carol@os"
    assert (await last_transition(pool, op))["worker"] == who and result.stdout.strip().endswith(f"by {who}")


@pytest.mark.parametrize(
    ("action", "state", "args"),
    [
        ("adopt", "succeeded", ["job_x", "--reason", "r"]),
        ("adopt", "stalled", ["job_x", "--reason", "r"]),
        ("adopt", "accepted", ["job_x", "--reason", "r"]),
        ("abandon", "submitted", ["--reason", "r"]),
        ("abandon", "rejected", ["--reason", "r"]),
        ("repoll", "uncertain", []),
        ("repoll", "failed", []),
        ("fail", "uncertain", ["--reason", "r"]),
        ("fail", "succeeded", ["--reason", "r"]),
    ],
)
async def test_other_states_are_refused_with_exit_3_and_nothing_written(
    cli: Settings, pool: asyncpg.Pool, seeded: Seeded, simulator: Simulator, action: str, state: str, args: list[str]
) -> None:
    op = seeded.by_state[state][0]
    before = await snapshot(pool, op)
    result = await streams_cli(cli, "operations", action, op, *args)
    assert result.exit_code == 3 and result.stdout == ""
    assert f"{action} operation '{op}' refused: it is {state};" in result.stderr
    assert "nothing was written" in result.stderr
    assert await snapshot(pool, op) == before
    await no_remote_calls(simulator)


async def test_adopting_another_operations_job_is_refused(cli: Settings, pool: asyncpg.Pool, seeded: Seeded) -> None:
    op = seeded.by_state["uncertain"][0]
    taken = seeded.job_ids[seeded.by_state["succeeded"][0]]
    before = await snapshot(pool, op)
    result = await streams_cli(cli, "operations", "adopt", op, taken, "--reason", "r")
    assert result.exit_code == 3 and f"remote job {taken} is already saved for operation" in result.stderr
    bad = await streams_cli(cli, "operations", "adopt", op, "job id with spaces", "--reason", "r")
    assert bad.exit_code == 3 and "is not a usable remote job id" in bad.stderr
    assert await snapshot(pool, op) == before


@pytest.mark.parametrize(
    "args",
    [
        ["adopt", "no-such-op", "job_x", "--reason", "r"],
        ["abandon", "no-such-op", "--reason", "r"],
        ["repoll", "no-such-op"],
        ["fail", "no-such-op", "--reason", "r"],
    ],
)
async def test_unknown_operation_exits_4(cli: Settings, seeded: Seeded, args: list[str]) -> None:
    result = await streams_cli(cli, "operations", *args)
    assert result.exit_code == 4 and "operation 'no-such-op' is not in the ledger" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["adopt", "op", "job"], "Missing option '--reason'"),
        (["abandon", "op"], "Missing option '--reason'"),
        (["fail", "op"], "Missing option '--reason'"),
        (["adopt", "op"], "Missing argument 'JOB_ID'"),
    ],
)
async def test_missing_input_exits_2(cli: Settings, args: list[str], message: str) -> None:
    result = await streams_cli(cli, "operations", *args)
    assert result.exit_code == 2 and message in result.stderr


async def test_a_blank_actor_cannot_hide_the_role_and_the_user(
    cli: Settings, pool: asyncpg.Pool, seeded: Seeded
) -> None:
    op = seeded.by_state["uncertain"][0]
    result = await streams_cli(
        cli, "operations", "abandon", op, "--reason", "r", "--actor", " ", env={"STREAMS_ACTOR": "", "USER": "fay"}
    )
    assert result.exit_code == 0, result.stderr
    assert (await last_transition(pool, op))["worker"] == "streams@postgres-role/fay@os"


@pytest.mark.parametrize("command", ["adopt", "abandon", "repoll", "fail"])
async def test_decision_help(cli: Settings, command: str) -> None:
    result = await streams_cli(cli, "operations", command, "--help")
    assert result.exit_code == 0 and "--actor" in result.stdout and "--json" in result.stdout
    assert "Refused (exit 3)" in " ".join(result.stdout.split())


# --- accounting ---------------------------------------------------------------------------------------------------


async def record_duplicate(pool: asyncpg.Pool, op: str) -> None:
    """A further job found by the reconciler's lookup for ``op``, recorded as a duplicate creation (the row the
    reconciler writes)."""
    await pool.execute(
        "INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by) "
        "VALUES ('job-dup', $1, 'duplicate', 'reconciler')",
        op,
    )


async def test_accounting_report_against_the_ledger(cli: Settings, pool: asyncpg.Pool, seeded: Seeded) -> None:
    await record_duplicate(pool, seeded.by_state["uncertain"][0])
    await backdate(pool, seeded.by_state["stalled"][0], "3 hours")
    report = (await streams_cli(cli, "accounting", "report", "--json")).json()
    by_outcome = {
        r["o"]: r["n"]
        for r in await pool.fetch(
            "SELECT COALESCE(outcome, 'not_terminal') AS o, count(*)::int AS n FROM remote_jobs GROUP BY 1"
        )
    }
    assert report["jobs_by_outcome"] == by_outcome == {"succeeded": 3, "failed": 1, "not_terminal": 4}
    by_via = {
        r["v"]: r["n"] for r in await pool.fetch("SELECT learned_via v, count(*)::int n FROM remote_jobs GROUP BY 1")
    }
    assert report["jobs_by_learned_via"] == by_via == {"post_2xx": 6, "post_502": 1, "duplicate": 1}
    assert (report["learned_only_via_502"], report["duplicate_creations"]) == (1, 1)
    assert report["charges"] == [{"currency": "USD", "amount": "1.75", "jobs": 2}]
    assert report["refunds_settled"] == [{"currency": "USD", "amount": "0.25", "refunds": 1}]
    assert report["refunds_pending"] == 1  # the failed job's charge
    assert report["needs_decision"]["uncertain"]["operations"] == 2
    assert report["needs_decision"]["stalled"]["operations"] == 1
    posts = await pool.fetch("SELECT operation_id, count(*) AS n FROM remote_calls WHERE method='POST' GROUP BY 1")
    assert report["posts_per_operation"]["operations"] == len(posts) == 9
    assert report["post_attempts"] == {
        "operations": 9,
        "mean_attempts": 1.0,
        "max_attempts": 1,
        "max_sent": 1,
        "operations_sent_twice": 0,
        "former_ids": 0,
    }
    gets = await pool.fetchval(
        "SELECT count(*) FROM remote_calls c JOIN operations o USING (operation_id) "
        "WHERE c.method = 'GET' AND o.state IN ('succeeded', 'failed', 'canceled')"
    )
    assert report["gets_per_completed_operation"] == {"operations": 4, "mean": gets / 4, "max": 1}

    text = (await streams_cli(cli, "accounting", "report")).stdout
    assert "remote jobs learned of             8\n" in text
    assert "  learned only through a 502       1\n" in text and "  duplicate creations              1\n" in text
    assert "charges                            USD 1.75 (2 jobs)\n" in text
    assert "refunds settled                    USD 0.25 (1 refunds)\n" in text
    assert "waiting for a decision             stalled 1 (oldest 3h00m), uncertain 2 (oldest " in text
    assert "  that may have created a job      max 1 (must be 1)\n" in text


async def test_accounting_report_flags_a_second_post_that_may_have_created_a_job(
    cli: Settings, pool: asyncpg.Pool, seeded: Seeded
) -> None:
    op = seeded.by_state["uncertain"][1]
    ledger = Ledger(pool, "seed-worker")
    await ledger.record_remote_call(
        RemoteCall(op, "POST", 429, RemoteCallOutcome.RATE_LIMITED, None, 1.0, 1)
    )  # nothing created: not counted
    only_429 = (await streams_cli(cli, "accounting", "report", "--json")).json()["post_attempts"]
    assert (only_429["max_attempts"], only_429["max_sent"]) == (2, 1)
    await ledger.record_remote_call(RemoteCall(op, "POST", None, RemoteCallOutcome.UNKNOWN_OUTCOME, None, 1.0, 1))
    report = await streams_cli(cli, "accounting", "report", "--operation-prefix", "ops-uncertain-")
    assert "  that may have created a job      max 2 (must be 1; BROKEN for 1 operations)" in report.stdout
    assert report.stdout.startswith("accounting of operations ops-uncertain-* at ")
    assert "POSTs per operation                mean 2.000, max 3 over 2 operations (every attempt" in report.stdout
    assert "GETs per completed operation       no operations\n" in report.stdout
