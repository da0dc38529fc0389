"""Outbox relay (including a crash between publish and mark) and bad input reaching the dead-letter topic."""

from __future__ import annotations

import base64
import logging
import time
import uuid
from typing import Any

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from streams.clients.follow import EventDeduplicator, read_topic_to_end
from streams.config import Settings
from streams.ledger import retention
from streams.ledger.records import SaveOutcome
from streams.model.answers import JobSnapshot
from streams.model.states import OperationState
from streams.worker.partitions import PartitionRoutes, producer_partition
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from streams.worker.stages.relay import OutboxRelay
from tests.integration.operators_support import backdate

pytestmark = pytest.mark.integration


async def succeeded_operation(runtime: Runtime, op: str, outputs: int, text: str = "x") -> None:
    """``op`` accepted, submitted as job ``job-<op>``, its poll claimed and observed ``succeeded`` with ``outputs``
    outputs ``out_<i>`` of ``text`` (each in the outbox, not yet published)."""
    assert await runtime.ledger.accept(op, '{"input": {"prompt": "p", "max_tokens": 1}}', submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit(op)
    assert fencing is not None
    assert await runtime.ledger.save_submitted(op, fencing, f"job-{op}", 0.0, None)
    polls = [p for p in await runtime.ledger.claim_due_polls(1000, 3.0) if p.operation_id == op]
    claim = await runtime.ledger.claim_for_observe(op, polls[0].poll_claim_id)
    assert claim is not None
    snap = JobSnapshot(
        f"job-{op}",
        "succeeded",
        OperationState.SUCCEEDED,
        outputs=[{"id": f"out_{i}", "text": text} for i in range(outputs)],
        completed_at_ms=123,
    )
    assert await runtime.ledger.save_observation(op, claim.fencing_token, snap, None) is SaveOutcome.SAVED


def for_op(records: list[Any], op: str) -> list[dict[str, Any]]:
    return [r.value for r in records if r.value.get("operation_id") == op]


async def test_relay_publishes_each_output_once_and_transitions_in_order(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings
) -> None:
    op = f"op-relay-{uuid.uuid4().hex[:6]}"
    await succeeded_operation(runtime, op, outputs=2)
    relay = OutboxRelay(runtime)
    assert await relay.tick() == 6  # 4 transitions + 2 outputs
    assert await relay.tick() == 0
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    outputs = for_op(await read_topic_to_end(settings, "outputs_delivered"), op)
    assert sorted(o["event_id"] for o in outputs) == [f"output:{op}:out_0", f"output:{op}:out_1"]
    assert all(o["remote_job_id"] == f"job-{op}" and o["remote_completed_at_ms"] == 123 for o in outputs)
    transitions = for_op(await read_topic_to_end(settings, "transitions"), op)
    assert [t["to_state"] for t in transitions] == ["accepted", "submitting", "submitted", "succeeded"]


async def test_crash_between_publish_and_mark_repeats_with_same_event_id(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings
) -> None:
    op = f"op-crash-{uuid.uuid4().hex[:6]}"
    await succeeded_operation(runtime, op, outputs=1)
    relay = OutboxRelay(runtime)

    async def publish_then_crash(rows: list[dict[str, Any]]) -> None:
        await relay._publish(rows)
        raise RuntimeError("relay killed after publish, before mark")

    with pytest.raises(RuntimeError):
        await runtime.ledger.relay_outbox(100, publish_then_crash)
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 5
    assert await relay.tick() == 5
    assert await pool.fetchval("SELECT count(*) FROM outputs WHERE operation_id=$1", op) == 1
    outputs = for_op(await read_topic_to_end(settings, "outputs_delivered"), op)
    assert [o["event_id"] for o in outputs] == [f"output:{op}:out_0"] * 2
    dedupe = EventDeduplicator()
    assert [o["event_id"] for o in outputs if dedupe.first_time(o["event_id"])] == [f"output:{op}:out_0"]


def submission_bytes(op: str, request: str = '{"input": {"prompt": "p", "max_tokens": 1}}') -> bytes:
    """A submission value whose request is the JSON text ``request``, written into the value as it is."""
    return f'{{"operation_id": "{op}", "request": {request}, "submitted_at_ms": {int(time.time() * 1000)}}}'.encode()


async def test_bad_input_reaches_dead_letter_topic_with_reason_and_bytes(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings
) -> None:
    tag = uuid.uuid4().hex[:6]
    oversized = submission_bytes(f"big-{tag}")[:-1] + b', "pad": "' + (b"x" * settings.max_value_bytes) + b'"}'
    cases: list[tuple[str, bytes, str, str]] = [
        ("submissions", b"\xff\xfenot json", "not_json", "not JSON"),
        ("submissions", orjson.dumps({"operation_id": f"m-{tag}", "submitted_at_ms": 1}), "schema", "request"),
        ("submissions", submission_bytes(f"w-{tag}", '{"model": 12}'), "schema", "request/model"),
        ("submissions", submission_bytes(f"d-{tag}", '{"a": 1, "a": 2}'), "not_json", "appears twice"),
        ("submissions", oversized, "oversized", "over the"),
        (
            "polls",
            orjson.dumps(
                {"operation_id": f"ghost-{tag}", "remote_job_id": "job-x", "poll_claim_id": 1, "claimed_at_ms": 1}
            ),
            "unknown_operation",
            f"ghost-{tag}",
        ),
    ]
    cases.append(
        (
            "submissions",
            submission_bytes(f"op-{tag}"),
            "key_mismatch",
            "is not the operation id",
        )
    )
    cases.append(
        (
            "submissions",
            submission_bytes(f"newline-{tag}\\n"),
            "schema",
            "operation_id",
        )
    )
    dispatcher, observer = Dispatcher(runtime), Observer(runtime)
    for i, (role, value, _, _) in enumerate(cases):
        message = RawMessage(settings.topic(role), 0, i, f"key-{tag}-{i}".encode(), value)
        await (dispatcher if role == "submissions" else observer).handle(message)
    letters = {
        base64.b64decode(r.value["key_base64"]).decode(): r.value
        for r in await read_topic_to_end(settings, "dead_letter")
        if r.value["key_base64"] and base64.b64decode(r.value["key_base64"]).decode().startswith(f"key-{tag}-")
    }
    assert len(letters) == len(cases)
    for i, (role, value, reason, words) in enumerate(cases):
        letter = letters[f"key-{tag}-{i}"]
        assert letter["reason"] == reason
        assert words in letter["error"]
        assert letter["source_topic"] == settings.topic(role) and letter["offset"] == i
        assert base64.b64decode(letter["original_base64"]) == value
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0  # nothing bad entered the ledger


async def test_unexpected_errors_are_retried_then_dead_lettered(
    runtime: Runtime, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    from streams.worker import app

    caplog.set_level(logging.WARNING, logger="streams.worker.app")
    tag = uuid.uuid4().hex[:6]
    calls: list[int] = []

    async def flaky(message: RawMessage) -> None:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("transient")

    ok = RawMessage(settings.topic("submissions"), 0, 1, f"ok-{tag}".encode(), b"{}")
    await app.handle_with_retries(runtime, flaky, ok)
    assert len(calls) == 3
    retried = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert retried == [  # the first failure logged, the second of the same type and key held back
        f"handling {ok.topic}[0]@1 failed (attempt 1 of {app.HANDLER_ATTEMPTS}, error): RuntimeError: transient; "
        "retrying"
    ]

    broken_calls: list[int] = []

    async def broken(message: RawMessage) -> None:
        broken_calls.append(1)
        raise RuntimeError("always")

    bad = RawMessage(settings.topic("submissions"), 0, 2, f"bad-{tag}".encode(), b'{"x": 1}')
    await app.handle_with_retries(runtime, broken, bad)
    assert len(broken_calls) == app.HANDLER_ATTEMPTS  # the plain first attempt counts as one of them
    letters = [
        r.value
        for r in await read_topic_to_end(settings, "dead_letter")
        if r.value["key_base64"] and base64.b64decode(r.value["key_base64"]).decode().endswith(tag)
    ]
    assert [(x["reason"], base64.b64decode(x["original_base64"])) for x in letters] == [
        ("processing_error", b'{"x": 1}')
    ]
    assert "RuntimeError: always" in letters[0]["error"]


SEED, T = "18446744073709551617", "0.1000000000000000055511151231257827"


def dup_request(seed: str = SEED, t: str = T) -> str:
    return f'{{"model": "m", "input": {{"prompt": "h\\u00e9", "max_tokens": 32}}, "seed": {seed}, "t": {t}}}'


#: The same request written otherwise: keys reordered, blanks, the escape written out, 32.0 for 32, a trailing 0.
SAME_REQUEST = f'{{ "t": {T}0, "seed": {SEED},\n "input": {{"max_tokens": 32.0, "prompt": "h\u00e9"}}, "model": "m" }}'


async def test_duplicate_operation_with_a_different_request_is_dead_lettered(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, simulator: object
) -> None:
    op = f"dup-{uuid.uuid4().hex[:6]}"
    # then requests that differ only where a double (or orjson) sees no difference
    texts = [dup_request(), SAME_REQUEST, dup_request(seed="18446744073709551616"), dup_request(t="0.1")]
    d = Dispatcher(runtime)
    for offset, text in enumerate(texts, 1):
        await d.handle(RawMessage(settings.topic("submissions"), 0, offset, op.encode(), submission_bytes(op, text)))
    letters = [
        r.value
        for r in await read_topic_to_end(settings, "dead_letter")
        if r.value["key_base64"] == base64.b64encode(op.encode()).decode()
    ]
    assert [(x["reason"], x["offset"]) for x in letters] == [("conflicting_duplicate", 3), ("conflicting_duplicate", 4)]
    assert "a different request needs a new operation id" in letters[0]["error"]
    stored = await pool.fetchval("SELECT request::text FROM operations WHERE operation_id = $1", op)
    assert stored == dup_request()
    assert await pool.fetchval("SELECT count(*) FROM remote_calls WHERE operation_id = $1", op) == 1


async def test_a_replay_after_a_purge_is_dead_lettered_and_never_posted_again(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, simulator: Any
) -> None:
    """``streams purge`` deleted the operation's row, the only record of its id: a replay (or a re-drive) of its
    submission was then accepted as a new operation and POSTed a second time. The purge now keeps the row, erased."""
    op = f"purged-{uuid.uuid4().hex[:6]}"
    d = Dispatcher(runtime)
    value = submission_bytes(op, '{"input": "not an object"}')  # the provider refuses it: rejected, terminal
    await d.handle(RawMessage(settings.topic("submissions"), 0, 1, op.encode(), value))
    assert (await simulator.get(f"/_sim/operations/{op}"))["posts"] == 1
    assert await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = $1", op) == "rejected"
    await pool.execute("UPDATE outbox SET published_at = now() WHERE operation_id = $1", op)  # as the relay does
    await backdate(pool, op, "2 days")
    purged = await retention.purge(pool, 86400.0, 100)
    assert purged.operations >= 1
    row = await pool.fetchrow(
        "SELECT request::text AS request, reason, purged_at IS NOT NULL AS purged FROM operations "
        "WHERE operation_id = $1",
        op,
    )
    assert row is not None
    assert (row["request"], row["reason"], row["purged"]) == ("null", "erased by streams purge", True)

    await d.handle(RawMessage(settings.topic("submissions"), 0, 2, op.encode(), value))  # the same record again
    assert (await simulator.get(f"/_sim/operations/{op}"))["posts"] == 1
    letters = [
        r.value
        for r in await read_topic_to_end(settings, "dead_letter")
        if r.value["key_base64"] == base64.b64encode(op.encode()).decode()
    ]
    assert [(x["reason"], x["offset"]) for x in letters] == [("conflicting_duplicate", 2)]
    assert "was erased" in letters[0]["error"] and "its id stays taken" in letters[0]["error"]
    assert await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = $1", op) == "rejected"
    assert await pool.fetchval("SELECT updated_by FROM operations WHERE operation_id = $1", op) != "test-worker"

    # a late job adopted for it (rejected -> submitted, docs/decisions.md) makes it whole again: a later purge takes it
    await pool.execute(
        "INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by) "
        "VALUES ($2, $1, 'created_after_decision', 'test')",
        op,
        f"job-late-{op}",
    )
    await pool.execute(
        "UPDATE operations SET state = 'submitted', remote_job_id = $2, updated_by = 'operator' "
        "WHERE operation_id = $1",
        op,
        f"job-late-{op}",
    )
    assert await pool.fetchval("SELECT purged_at FROM operations WHERE operation_id = $1", op) is None


async def test_a_blocked_partition_holds_up_only_its_own_operations(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings
) -> None:
    tag = uuid.uuid4().hex[:6]
    healthy, blocked = f"op-healthy-{tag}", f"op-blocked-{tag}"
    await succeeded_operation(runtime, healthy, outputs=1)
    await succeeded_operation(runtime, blocked, outputs=1)
    runtime.routes = PartitionRoutes(lambda topic, key: 1 if key == blocked.encode() else 0)
    runtime.routes.update({(settings.topic("transitions"), 1), (settings.topic("outputs_delivered"), 1)})
    relay = OutboxRelay(runtime)

    assert await relay.tick() == 5  # the healthy operation's rows, in the round the blocked one's wait
    unpublished = "SELECT count(*) FROM outbox WHERE operation_id = $1 AND published_at IS NULL"
    assert (await pool.fetchval(unpublished, healthy), await pool.fetchval(unpublished, blocked)) == (0, 5)
    assert await runtime.ledger.relay_outbox(100, relay._publish, relay._skip_operation_ids()) == 0  # left out
    assert for_op(await read_topic_to_end(settings, "transitions"), blocked) == []

    runtime.routes.update(set())  # a leader again
    assert await relay.tick() == 5
    assert await pool.fetchval(unpublished, blocked) == 0
    transitions = for_op(await read_topic_to_end(settings, "transitions"), blocked)
    assert [t["to_state"] for t in transitions] == ["accepted", "submitting", "submitted", "succeeded"]


async def test_the_partition_named_for_a_key_is_the_one_the_producer_sends_it_to(migrated: Settings) -> None:
    # A topic of its own, with the product's partition count: the session's topics carry only their own events
    # (other tests read them whole).
    topic = f"{migrated.topic_prefix}partition-probe-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=migrated.kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=migrated.partitions, replication_factor=1)])
        producer = AIOKafkaProducer(bootstrap_servers=migrated.kafka_bootstrap, acks="all")
        await producer.start()
        try:
            assert producer_partition(producer, f"{topic}.unknown", b"op") is None  # metadata does not know it
            await producer.client.force_metadata_update()
            await producer.client._wait_on_metadata(topic)
            keys = [f"op-{uuid.uuid4().hex[:8]}".encode() for _ in range(40)]
            named = [producer_partition(producer, topic, key) for key in keys]
            sent = [(await producer.send_and_wait(topic, b"{}", key=key)).partition for key in keys]
        finally:
            await producer.stop()
    finally:
        await admin.delete_topics([topic])
        await admin.close()
    assert named == sent and len(set(sent)) == migrated.partitions
