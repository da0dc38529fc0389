"""``streams dead-letters list|show|redrive`` over dead letters the real dispatcher wrote to the real broker, and
the dead-letter topic's retention set by ``streams migrate`` (read back with describe_configs)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import asyncpg
import pytest

from streams.clients.follow import read_topic_to_end
from streams.config import Settings
from streams.ledger.records import RemoteCall
from streams.model.codes import RemoteCallOutcome
from streams.setup.admin import RETENTION_MS, KafkaAdmin
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.dispatcher import Dispatcher
from tests.integration.operators_support import streams_cli

pytestmark = pytest.mark.integration

REQUEST = '{"input": {"prompt": "secret prompt", "max_tokens": 1}}'


def submission(op: str, request: str = REQUEST) -> bytes:
    return f'{{"operation_id": "{op}", "request": {request}, "submitted_at_ms": {int(time.time() * 1000)}}}'.encode()


async def listed(settings: Settings, op: str) -> list[dict[str, object]]:
    result = await streams_cli(settings, "dead-letters", "list", "--operation-id", op, "--json")
    assert result.exit_code == 0, result.stderr
    out = result.json()
    assert out["stopped"] is None
    return list(out["dead_letters"])


async def test_list_show_and_redrive_a_fixed_dead_letter(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, tmp_path: Path
) -> None:
    op = f"dl-{uuid.uuid4().hex[:6]}"
    broken = submission(op)[:-1]  # the closing brace lost: not JSON
    await Dispatcher(runtime).handle(RawMessage(settings.topic("submissions"), 0, 7, op.encode(), broken))

    (letter,) = await listed(settings, op)
    assert (letter["reason"], letter["operation_id"], letter["original_size"]) == ("not_json", op, len(broken))
    assert letter["source"] == f"{settings.topic('submissions')}[0]@7"
    assert 0 <= letter["age_s"] < 120  # type: ignore[operator]
    record = str(letter["record"])

    shown = await streams_cli(settings, "dead-letters", "show", record, "--json")
    assert shown.exit_code == 0, shown.stderr
    assert shown.json()["payload"] is None and "secret prompt" not in shown.stdout
    text = await streams_cli(settings, "dead-letters", "show", record)
    assert "secret prompt" not in text.stdout and "--show-payload" in text.stdout
    with_payload = await streams_cli(settings, "dead-letters", "show", record, "--show-payload", "--json")
    assert with_payload.json()["payload"].encode() == broken

    # the original is still broken: refused, nothing published or recorded
    refused = await streams_cli(settings, "dead-letters", "redrive", record, "--why", "try again")
    assert refused.exit_code == 3 and "still invalid (not_json" in refused.stdout
    assert await pool.fetchval("SELECT count(*) FROM dead_letter_redrives") == 0

    fixed = tmp_path / "fixed.json"
    fixed.write_bytes(submission(op))
    result = await streams_cli(
        settings,
        "dead-letters",
        "redrive",
        record,
        "--value-file",
        str(fixed),
        "--why",
        "closed the JSON object",
        "--actor",
        "ivan",
        "--json",
        env={"USER": "ivy"},
    )
    assert result.exit_code == 0, result.stderr
    out = result.json()
    (done,) = out["redrives"]
    assert (done["record"], done["operation_id"], done["value_source"], done["refused"]) == (record, op, "file", None)
    target = done["published"]
    republished = [
        r
        for r in await read_topic_to_end(settings, "submissions")
        if (r.partition, r.offset) == (target["partition"], target["offset"])
    ]
    assert [r.raw for r in republished] == [fixed.read_bytes()]
    row = await pool.fetchrow("SELECT * FROM dead_letter_redrives WHERE id = $1", done["redrive_id"])
    assert (row["operation_id"], row["value_source"], row["why"], row["actor"], row["dead_letter_reason"]) == (
        op,
        "file",
        "closed the JSON object",
        "streams@postgres-role/ivy@os (given: ivan)",
        "not_json",
    )
    again = await streams_cli(settings, "dead-letters", "show", record)
    assert "re-driven        1 times" in again.stdout and "closed the JSON object" in again.stdout


async def test_a_redrive_asking_for_another_request_than_the_ledger_holds_is_refused(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, tmp_path: Path, simulator: object
) -> None:
    op = f"dup-{uuid.uuid4().hex[:6]}"
    d = Dispatcher(runtime)
    other = '{"input": {"prompt": "another", "max_tokens": 1}}'
    await d.handle(RawMessage(settings.topic("submissions"), 0, 1, op.encode(), submission(op)))
    await d.handle(RawMessage(settings.topic("submissions"), 0, 2, op.encode(), submission(op, other)))
    (letter,) = await listed(settings, op)
    assert letter["reason"] == "conflicting_duplicate"

    refused = await streams_cli(settings, "dead-letters", "redrive", "--operation-id", op, "--why", "w")
    assert refused.exit_code == 3 and "another request" in refused.stdout
    # the same request written otherwise (keys reordered, 1.0 for 1) is the same request: re-driven
    same = tmp_path / "same.json"
    same.write_text(
        json.dumps(
            {
                "request": {"input": {"max_tokens": 1.0, "prompt": "secret prompt"}},
                "operation_id": op,
                "submitted_at_ms": 1,
            }
        )
    )
    dry = await streams_cli(
        settings,
        "dead-letters",
        "redrive",
        "--reason",
        "conflicting_duplicate",
        "--operation-id",
        op,
        "--value-file",
        str(same),
        "--why",
        "w",
        "--dry-run",
    )
    assert dry.exit_code == 0 and "would be re-driven (dry run)" in dry.stdout, dry.stderr
    assert await pool.fetchval("SELECT count(*) FROM dead_letter_redrives") == 0


async def test_a_replay_of_a_purged_id_is_noted_and_its_dead_letter_is_never_redriven_once_the_id_is_deleted(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, tmp_path: Path, simulator: object
) -> None:
    """A replay that came after the purge left copies on the topics the purge's horizon did not count (it counted
    from the purge): the replay is noted on the kept row, and its dead letter (any dead letter of the id: the
    accounting keeps the POST), once the id is deleted, would have been re-driven as a new operation and POSTed
    again."""
    op = f"rp-{uuid.uuid4().hex[:6]}"
    d = Dispatcher(runtime)
    assert await runtime.ledger.accept(op, REQUEST, submitted_at_ms=1)
    await runtime.ledger.record_remote_call(RemoteCall(op, "POST", 201, RemoteCallOutcome.CREATED, "job_x", 5.0, 1))
    await pool.execute(  # sent, canceled, then purged: as streams purge leaves it
        "UPDATE operations SET state = 'canceled', request = 'null'::json, purged_at = now() - interval '1 day' "
        "WHERE operation_id = $1",
        op,
    )
    assert await pool.fetchval("SELECT replayed_at FROM operations WHERE operation_id = $1", op) is None
    await d.handle(RawMessage(settings.topic("submissions"), 0, 2, op.encode(), submission(op)))
    (letter,) = await listed(settings, op)
    assert letter["reason"] == "conflicting_duplicate"
    noted = await pool.fetchval(
        "SELECT now() - replayed_at < interval '1 minute' FROM operations WHERE operation_id = $1", op
    )
    assert noted is True

    for table in ("outbox", "transitions", "operations"):  # as streams purge, then --ids-older-than, do later
        await pool.execute(f"DELETE FROM {table} WHERE operation_id = $1", op)
    refused = await streams_cli(settings, "dead-letters", "redrive", "--operation-id", op, "--why", "w")
    assert refused.exit_code == 3, refused.stderr
    assert "was asked for operation" in refused.stdout and "1 POST attempts" in refused.stdout
    renamed = tmp_path / "renamed.json"
    renamed.write_bytes(submission(f"{op}-new"))  # meant as a new operation: a new id
    dry = await streams_cli(
        settings,
        "dead-letters",
        "redrive",
        "--operation-id",
        op,
        "--value-file",
        str(renamed),
        "--why",
        "w",
        "--dry-run",
    )
    assert dry.exit_code == 0 and "would be re-driven (dry run)" in dry.stdout, dry.stdout + dry.stderr


async def test_redrive_needs_a_selection_and_list_is_bounded(settings: Settings, migrated: Settings) -> None:
    usage = await streams_cli(settings, "dead-letters", "redrive", "--why", "w")
    assert usage.exit_code == 2 and "select dead letters" in usage.stderr
    result = await streams_cli(settings, "dead-letters", "list", "--limit", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert len(result.json()["dead_letters"]) <= 1
    missing = await streams_cli(settings, "dead-letters", "show", "0:999999999")
    assert missing.exit_code == 4


async def test_migrate_sets_the_dead_letter_topics_retention(settings: Settings) -> None:
    result = await streams_cli(settings, "migrate", env={"STREAMS_DEAD_LETTER_RETENTION_MS": "3600000"})
    assert result.exit_code == 0, result.stderr
    assert f"{RETENTION_MS}=3600000" in result.stdout
    async with KafkaAdmin(settings) as admin:
        configs = await admin.describe_topic_configs(settings.topic("dead_letter"), [RETENTION_MS])
    assert configs == {RETENTION_MS: "3600000"}
