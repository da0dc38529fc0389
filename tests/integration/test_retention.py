"""Retention and erasure on the real ledger: ``streams purge`` erases old terminal operations and deletes their rows
in batches, keeping each id and the accounting; ``streams operations forget`` erases one operation's request, source and
outputs and records it; the operator role (migration 0008, granted more by 0009) may do both and no more."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from streams.config import Settings
from streams.errors import OperatorActionRefusedError
from streams.ledger import retention
from streams.ledger.pool import create_pool
from streams.ledger.records import RemoteCall
from streams.ledger.store import Ledger
from streams.model.codes import RemoteCallOutcome
from streams.setup.admin import REPLAY_MARGIN_S, create_topics, delete_topics, replay_windows
from tests.integration.operators_support import REQUEST, SUBMITTED_AT_MS, Seeded, backdate, seed_ledger, streams_cli
from tests.support import unique_settings

pytestmark = pytest.mark.integration

ACCOUNTING = (
    "SELECT (SELECT count(*) FROM remote_calls), (SELECT count(*) FROM remote_jobs), (SELECT count(*) FROM refunds)"
)


@pytest.fixture
async def seeded(pool: asyncpg.Pool) -> Seeded:
    return await seed_ledger(Ledger(pool, "seed-worker"), "ret")


@pytest.fixture
async def own(settings: Settings) -> AsyncIterator[Settings]:
    """The settings with topics and a workers' consumer group of their own (the session's topics hold other tests'
    submissions, which no worker of the session's group consumed), the topics made and deleted again."""
    mine = unique_settings(settings)
    await create_topics(mine)
    yield mine
    await delete_topics(mine)


async def rows_of(pool: asyncpg.Pool, op: str) -> tuple[int, int, int, int]:
    """(operations, transitions, outputs, outbox) rows of ``op``."""
    row = await pool.fetchrow(
        "SELECT (SELECT count(*) FROM operations WHERE operation_id = $1), "
        "(SELECT count(*) FROM transitions WHERE operation_id = $1), "
        "(SELECT count(*) FROM outputs WHERE operation_id = $1), "
        "(SELECT count(*) FROM outbox WHERE operation_id = $1)",
        op,
    )
    assert row is not None
    return tuple(row.values())


async def published(pool: asyncpg.Pool, *ops: str) -> None:
    """Mark the outbox rows of ``ops`` published (as the relay does)."""
    await pool.execute("UPDATE outbox SET published_at = now() WHERE operation_id = ANY($1::text[])", list(ops))


async def test_purge_erases_old_terminal_operations_in_batches_and_keeps_their_ids_and_the_accounting(
    settings: Settings, pool: asyncpg.Pool, seeded: Seeded
) -> None:
    old = [*seeded.by_state["succeeded"][:2], *seeded.by_state["failed"], *seeded.by_state["rejected"]]
    for op in old:
        await backdate(pool, op, "2 days")
    held = seeded.by_state["succeeded"][1]  # old enough, but one outbox row still unpublished
    await published(pool, *[op for op in old if op != held])
    await pool.execute(
        "UPDATE outbox SET published_at = now() WHERE operation_id = $1 AND topic_role = 'transitions'", held
    )
    for op in (*seeded.by_state["submitted"], *seeded.by_state["stalled"], *seeded.by_state["uncertain"]):
        await backdate(pool, op, "3 days")  # old, not terminal: never purged
    purged = [op for op in old if op != held]
    expected = [await rows_of(pool, op) for op in purged]
    accounting = tuple((await pool.fetchrow(ACCOUNTING)).values())
    operations_before = await pool.fetchval("SELECT count(*) FROM operations")

    dry = await streams_cli(settings, "purge", "--older-than", "1d", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stderr
    out = dry.json()
    assert (out["operations"], out["held_by_outbox"]) == (3, 1)
    assert (out["transitions"], out["outputs"], out["outbox"]) == tuple(sum(e[i] for e in expected) for i in (1, 2, 3))
    assert out["oldest_age_s"] > 2 * 86400 - 60
    assert await pool.fetchval("SELECT count(*) FROM operations") == operations_before  # nothing deleted

    result = await streams_cli(settings, "purge", "--older-than", "1d", "--batch-size", "2", "--json")
    assert result.exit_code == 0, result.stderr
    done = result.json()
    assert (done["operations"], done["batches"]) == (3, 2)
    assert (done["transitions"], done["outputs"], done["outbox"]) == (out["transitions"], out["outputs"], out["outbox"])
    for op in purged:  # the row of the id stays, erased: the guard against a replay of its submission
        assert await rows_of(pool, op) == (1, 0, 0, 0)
        kept = await pool.fetchrow(
            "SELECT request::text AS request, source, last_observation, purged_at IS NOT NULL AS purged "
            "FROM operations WHERE operation_id = $1",
            op,
        )
        assert kept is not None and tuple(kept.values()) == ("null", None, None, True)
    assert (await rows_of(pool, held))[0] == 1
    assert await pool.fetchval("SELECT purged_at FROM operations WHERE operation_id = $1", held) is None
    assert await pool.fetchval("SELECT count(*) FROM operations") == operations_before
    assert tuple((await pool.fetchrow(ACCOUNTING)).values()) == accounting  # every accounting row stays
    job = seeded.job_ids[seeded.by_state["succeeded"][0]]
    assert await pool.fetchval("SELECT count(*) FROM refunds WHERE remote_job_id = $1", job) == 1

    again = await streams_cli(settings, "purge", "--older-than", "1d")  # the purged ones are not counted again
    assert again.exit_code == 0 and "purged 0 operations" in again.stdout
    assert (await retention.purge_preview(pool, 86400.0))["operations"] == 0


async def purged_ago(pool: asyncpg.Pool, op: str, interval: str) -> None:
    """Purge ``op``'s row by hand as ``streams purge`` erased it ``interval`` ago (its log, outputs, outbox gone)."""
    for table in ("outbox", "outputs"):
        await pool.execute(f"DELETE FROM {table} WHERE operation_id = $1", op)
    await pool.execute("DELETE FROM transitions WHERE operation_id = $1", op)
    await pool.execute(
        "UPDATE operations SET request = 'null'::json, purged_at = now() - $2::text::interval WHERE operation_id = $1",
        op,
        interval,
    )


async def test_purge_deletes_the_ids_purged_before_a_horizon_only_once_the_topics_can_replay_none_of_them(
    own: Settings, pool: asyncpg.Pool, seeded: Seeded
) -> None:
    settings = own
    windows = await replay_windows(settings)
    assert [w.exists for w in windows] == [True, True, True] and all(w.longest_ms for w in windows)
    longest_s = max(w.longest_ms or 0 for w in windows) / 1000 + REPLAY_MARGIN_S
    long_ago = f"{longest_s + 2 * 86400} seconds"
    old, late, replayed = seeded.by_state["failed"][0], *seeded.by_state["succeeded"][:2]
    revived = seeded.by_state["rejected"][0]
    for op in (old, late, replayed, revived):
        await purged_ago(pool, op, long_ago)
    # a replay of its id came an hour ago and was dead-lettered: its copies on the topics keep the id taken
    await pool.execute(
        "UPDATE operations SET replayed_at = now() - interval '1 hour' WHERE operation_id = $1", replayed
    )
    # purged, then a late job adopted (rejected -> submitted): its trigger clears purged_at, the id is never deleted
    await pool.execute(
        "INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by) "
        "VALUES ('job_adopted_late', $1, 'created_after_decision', 'w')",
        revived,
    )
    await pool.execute(
        "UPDATE operations SET state = 'submitted', remote_job_id = 'job_adopted_late' WHERE operation_id = $1", revived
    )
    assert await pool.fetchval("SELECT purged_at FROM operations WHERE operation_id = $1", revived) is None
    job = seeded.job_ids[late]  # a completion callback that came after the purge: its record goes with the id
    await pool.execute(
        "INSERT INTO callback_deliveries (webhook_id, remote_job_id, operation_id, poll_made_due, received_by) "
        "VALUES ('msg_1', $1, $2, false, 'w')",
        job,
        late,
    )
    await pool.execute(  # a cancellation would cancel a new operation of the freed id before its POST
        "INSERT INTO cancellations (operation_id, path, actor, reason) VALUES ($1, 'operator', 'a', 'r')", old
    )
    accounting = tuple((await pool.fetchrow(ACCOUNTING)).values())
    terminal_old = seeded.by_state["succeeded"][2]  # purged by the same command, whatever the ids' check says
    await published(pool, terminal_old)
    await backdate(pool, terminal_old, "2 days")
    horizon = f"{int(longest_s) + 86400}s"

    at_margin = await streams_cli(settings, "purge", "--older-than", "1d", "--ids-older-than", f"{int(longest_s)}s")
    assert at_margin.exit_code == 3, at_margin.stderr
    assert "refused, no id deleted" in at_margin.stderr and settings.topic("dead_letter") in at_margin.stderr
    assert "--skip-replay-check" in at_margin.stderr
    assert at_margin.stdout.startswith("batch 1: 1 operations purged\npurged 1 operations")  # the purge ran first
    assert await pool.fetchval("SELECT purged_at IS NOT NULL FROM operations WHERE operation_id = $1", terminal_old)
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE purged_at IS NOT NULL") == 4

    dry = await streams_cli(settings, "purge", "--older-than", "1d", "--ids-older-than", horizon, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.stderr
    ids = dry.json()["ids"]
    assert (ids["ids"], ids["callback_deliveries"], ids["cancellations"]) == (2, 1, 1)
    assert ids["oldest_age_s"] > longest_s + 86400
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE purged_at IS NOT NULL") == 4

    result = await streams_cli(
        settings, "purge", "--older-than", "1d", "--ids-older-than", horizon, "--batch-size", "1"
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        "deleted 2 purged ids with 1 callback deliveries and 1 cancellations in 2 batches"
    )
    kept = await pool.fetchval(
        "SELECT array_agg(operation_id ORDER BY operation_id) FROM operations WHERE purged_at IS NOT NULL"
    )
    assert kept == sorted([replayed, terminal_old])
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE operation_id = ANY($1::text[])", [old, late]) == 0
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE operation_id = $1", revived) == 1
    assert await pool.fetchval("SELECT count(*) FROM callback_deliveries") == 0
    assert await pool.fetchval("SELECT count(*) FROM cancellations") == 0
    assert tuple((await pool.fetchrow(ACCOUNTING)).values()) == accounting  # the accounting stays whole

    # the freed id taken by a new operation: the accounting counts its own calls, not its former operation's
    ledger = Ledger(pool, "new-worker")
    assert await ledger.accept(old, REQUEST, submitted_at_ms=SUBMITTED_AT_MS)
    await ledger.record_remote_call(RemoteCall(old, "POST", 201, RemoteCallOutcome.CREATED, "job_new", 5.0, 1))
    # the seeded POST of its former operation is not the new one's second POST
    await ledger.record_remote_call(RemoteCall(late, "POST", 201, RemoteCallOutcome.CREATED, "job_late2", 5.0, 1))
    assert (await ledger.accounting_summary(old))["posts_per_operation"] == {"operations": 1, "mean": 1.0, "max": 1}
    report = await streams_cli(settings, "accounting", "report", "--operation-prefix", old, "--json")
    assert report.exit_code == 0, report.stderr
    attempts = report.json()["post_attempts"]
    assert (attempts["max_sent"], attempts["operations"], attempts["former_ids"]) == (1, 1, 1)
    # a freed id with two former operations' POSTs (and none held): no "BROKEN"
    twice = await streams_cli(settings, "accounting", "report", "--operation-prefix", late)
    assert twice.exit_code == 0 and "BROKEN" not in twice.stdout and "1 freed ids" in twice.stdout, twice.stdout
    await pool.execute(
        "UPDATE operations SET replayed_at = now() - interval '2 days' WHERE operation_id = $1", replayed
    )
    too_short = await streams_cli(
        settings, "purge", "--older-than", "1d", "--ids-older-than", "23h", "--skip-replay-check"
    )
    assert too_short.exit_code == 2 and "at least 1d00h" in too_short.stderr, too_short.stderr
    unchecked = await streams_cli(
        settings, "purge", "--older-than", "1d", "--ids-older-than", "1d", "--skip-replay-check", "--json"
    )
    assert unchecked.exit_code == 0, unchecked.stderr
    assert unchecked.json()["ids"] == {"batches": 1, "ids": 1, "callback_deliveries": 0, "cancellations": 0}
    # the one purged by this test's first command, seconds ago, stays
    assert await pool.fetchval("SELECT array_agg(operation_id) FROM operations WHERE purged_at IS NOT NULL") == [
        terminal_old
    ]

    alone = await streams_cli(settings, "purge", "--older-than", "1d", "--skip-replay-check")
    assert alone.exit_code == 2 and "go with --ids-older-than" in alone.stderr
    timeout_alone = await streams_cli(settings, "purge", "--older-than", "1d", "--catch-up-timeout-s", "5")
    assert timeout_alone.exit_code == 2 and "go with --ids-older-than" in timeout_alone.stderr


async def test_a_job_created_after_the_decision_keeps_its_id(own: Settings, pool: asyncpg.Pool, seeded: Seeded) -> None:
    """A job the provider created after the operation was decided is found by operation id (the late-job listings,
    the accounting, adopt): a new operation of a freed id would be offered the former one's job."""
    observed, unobserved = seeded.by_state["rejected"][0], seeded.by_state["failed"][0]
    for op in (observed, unobserved):
        await purged_ago(pool, op, "1000 days")
        await pool.execute(
            "INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by) "
            "VALUES ($1, $2, 'created_after_decision', 'w')",
            f"job_late_{op}",
            op,
        )
    # the late job seen (its id saved on the row): the first version deleted this id
    await pool.execute(
        "UPDATE operations SET remote_job_id = $2 WHERE operation_id = $1", observed, f"job_late_{observed}"
    )
    result = await streams_cli(own, "purge", "--older-than", "1d", "--ids-older-than", "900d", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["ids"]["ids"] == 0
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM operations WHERE operation_id = ANY($1::text[])", [observed, unobserved]
        )
        == 2
    )


async def test_ids_are_deleted_only_once_the_workers_consumed_every_submission_written_before(
    own: Settings, pool: asyncpg.Pool, seeded: Seeded
) -> None:
    """A resend of a purged id written before the command but not yet consumed (workers stopped, a partition
    behind) has not met the id: the id would be free when it is read, and it would be POSTed again."""
    op = seeded.by_state["failed"][0]
    await purged_ago(pool, op, "1000 days")
    topic = own.topic("submissions")
    producer = AIOKafkaProducer(bootstrap_servers=own.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        sent = await producer.send_and_wait(topic, b'{"resent": true}', key=op.encode())
    finally:
        await producer.stop()
    args = ("purge", "--older-than", "1d", "--ids-older-than", "900d", "--catch-up-timeout-s", "1")
    behind = await streams_cli(own, *args, "--json")
    assert behind.exit_code == 3, behind.stderr
    assert "has not consumed" in behind.json()["ids"]["refused"] and behind.json()["operations"] == 0
    assert f"{own.app_id} has not consumed" in behind.stderr
    assert f"{topic}[{sent.partition}]: consumed up to 0 of {sent.offset + 1}" in behind.stderr
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE operation_id = $1", op) == 1

    workers = AIOKafkaConsumer(bootstrap_servers=own.kafka_bootstrap, group_id=own.app_id, enable_auto_commit=False)
    await workers.start()
    try:  # the workers' group read it (and met the id: a replay dead-lettered, noted on the row)
        tp = TopicPartition(topic, sent.partition)
        workers.assign([tp])
        await workers.commit({tp: sent.offset + 1})
    finally:
        await workers.stop()
    caught_up = await streams_cli(own, *args)
    assert caught_up.exit_code == 0, caught_up.stderr
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE operation_id = $1", op) == 0


async def test_the_ledger_refuses_to_delete_an_operation_that_is_not_terminal(
    pool: asyncpg.Pool, seeded: Seeded
) -> None:
    op = seeded.by_state["submitted"][0]
    with pytest.raises(asyncpg.CheckViolationError, match="not terminal"):
        await pool.execute("DELETE FROM transitions WHERE operation_id = $1", op)
    await pool.execute("DELETE FROM outbox WHERE operation_id = $1", op)
    with pytest.raises(asyncpg.CheckViolationError, match="not terminal"):
        await pool.execute("DELETE FROM operations WHERE operation_id = $1", op)


async def test_forget_erases_request_source_and_outputs_and_records_it(
    settings: Settings, pool: asyncpg.Pool, seeded: Seeded
) -> None:
    op = seeded.by_state["succeeded"][0]
    await pool.execute('UPDATE operations SET source = \'{"app": "chat"}\' WHERE operation_id = $1', op)
    await published(pool, op)
    log_before = await pool.fetch("SELECT * FROM transitions WHERE operation_id = $1 ORDER BY id", op)
    result = await streams_cli(
        settings, "operations", "forget", op, "--reason", "erasure request 42", "--json", env={"USER": "gina"}
    )
    assert result.exit_code == 0, result.stderr
    out = result.json()
    assert (out["operation_id"], out["outputs_erased"]) == (op, 2)
    assert out["actor"] == "streams@postgres-role/gina@os"
    row = await pool.fetchrow(
        "SELECT request::text, source, last_observation, state::text, updated_by FROM operations WHERE operation_id=$1",
        op,
    )
    assert tuple(row.values()) == ("null", None, None, "succeeded", "streams@postgres-role/gina@os")
    assert [r["payload"] for r in await pool.fetch("SELECT payload FROM outputs WHERE operation_id = $1", op)] == [
        None,
        None,
    ]
    outbox = await pool.fetch(
        "SELECT payload FROM outbox WHERE operation_id = $1 AND topic_role = 'outputs_delivered'", op
    )
    assert len(outbox) == 2 and all(r["payload"]["output"] is None and r["payload"]["output_id"] for r in outbox)
    erasures = await retention.erasures_of(pool, op)
    assert [(e["reason"], e["actor"], e["outputs_erased"]) for e in erasures] == [
        ("erasure request 42", "streams@postgres-role/gina@os", 2)
    ]
    assert await pool.fetch("SELECT * FROM transitions WHERE operation_id = $1 ORDER BY id", op) == log_before
    text = await pool.fetchval("SELECT string_agg(payload::text, '') FROM outbox WHERE operation_id = $1", op)
    assert f"output 0 of {op}" not in text


async def test_forget_is_refused_while_an_operation_is_in_use_or_unpublished(
    settings: Settings, pool: asyncpg.Pool, seeded: Seeded
) -> None:
    submitted, unpublished = seeded.by_state["submitted"][0], seeded.by_state["succeeded"][1]
    for op, message in ((submitted, "not terminal"), (unpublished, "not yet published")):
        before = await pool.fetchval("SELECT request::text FROM operations WHERE operation_id = $1", op)
        result = await streams_cli(settings, "operations", "forget", op, "--reason", "r")
        assert result.exit_code == 3 and message in result.stderr and "nothing was written" in result.stderr
        assert await pool.fetchval("SELECT request::text FROM operations WHERE operation_id = $1", op) == before
    purged = seeded.by_state["failed"][0]
    await purged_ago(pool, purged, "1 minute")
    again = await streams_cli(settings, "operations", "forget", purged, "--reason", "r")
    assert again.exit_code == 3 and "streams purge erased it at" in again.stderr, again.stderr
    missing = await streams_cli(settings, "operations", "forget", "no-such-op", "--reason", "r")
    assert missing.exit_code == 4
    assert await pool.fetchval("SELECT count(*) FROM erasures") == 0


def _as(settings: Settings, role: str, password: str) -> str:
    parts = urlsplit(settings.database_url.get_secret_value())
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{parts.hostname}:{parts.port or 5432}"))


@pytest.fixture
async def operator_pool(migrated: Settings, pool: asyncpg.Pool) -> AsyncIterator[asyncpg.Pool]:
    """A pool logged in as a fresh login role granted ``streams_operator`` (dropped afterwards)."""
    role, password = f"t_op_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await pool.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}' IN ROLE streams_operator")
    p = await create_pool(_as(migrated, role, password), min_size=1, max_size=2)
    yield p
    await p.close()
    await pool.execute(f"DROP ROLE {role}")


async def test_the_operator_role_purges_and_forgets_and_rewrites_nothing_else(
    pool: asyncpg.Pool, seeded: Seeded, operator_pool: asyncpg.Pool
) -> None:
    forgotten, purged = seeded.by_state["succeeded"][0], seeded.by_state["failed"][0]
    await published(pool, forgotten, purged)
    await backdate(pool, purged, "2 days")
    erasure = await retention.forget(operator_pool, forgotten, "request 7", "op@postgres-role/h@os")
    assert erasure.outputs_erased == 2
    assert (await retention.purge(operator_pool, 86400.0, 10)).operations == 1
    await pool.execute(
        "UPDATE operations SET purged_at = purged_at - interval '2 days' WHERE operation_id = $1", purged
    )
    assert await retention.forget_ids(operator_pool, 86400.0, 10) == retention.ForgottenIds(ids=1)
    assert await retention.database_role(operator_pool) != "streams"
    refused = [
        "UPDATE transitions SET reason = 'rewritten'",
        "UPDATE outputs SET output_id = 'x'",
        "UPDATE outbox SET published_at = NULL",
        "UPDATE erasures SET reason = 'x'",
        "DELETE FROM erasures",
        "DELETE FROM remote_calls",
        "DELETE FROM remote_jobs",
        "DELETE FROM refunds",
        "DELETE FROM dead_letter_redrives",
    ]
    async with operator_pool.acquire() as conn:
        for statement in refused:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)


async def test_forget_needs_a_reason(pool: asyncpg.Pool, seeded: Seeded) -> None:
    with pytest.raises(OperatorActionRefusedError, match="a reason and an actor"):
        await retention.forget(pool, seeded.by_state["succeeded"][0], " ", "a")
