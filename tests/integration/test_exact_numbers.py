"""Numbers on their way through the real services: Kafka -> dispatcher -> PostgreSQL -> simulator -> observer ->
outbox -> Kafka. Every number arrives exactly as sent, or the input is refused with its reason; and a
``Retry-After`` the client cannot read never stops the polling."""

from __future__ import annotations

import base64
import time
import uuid

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streams.clients.follow import read_topic_to_end
from streams.config import Settings
from streams.errors import RemoteRateLimitedError
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from streams.worker.stages.relay import OutboxRelay
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration

FINAL = ("succeeded", "failed", "canceled", "uncertain", "rejected")


async def through_kafka(settings: Settings, op: str, value: bytes) -> RawMessage:
    """Publish ``value`` to the submissions topic and read the same record back: what a worker consumes."""
    topic = settings.topic("submissions")
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        sent = await producer.send_and_wait(topic, value, key=op.encode())
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, sent.partition)
        consumer.assign([tp])
        consumer.seek(tp, sent.offset)
        m = await consumer.getone()
    finally:
        await consumer.stop()
    assert (m.offset, m.value) == (sent.offset, value)
    return RawMessage(m.topic, m.partition, m.offset, m.key, m.value)


def submission(op: str, rest: bytes, generated_tokens: int = 5) -> bytes:
    """A submission's text, written by hand: no JSON library between the test and Kafka."""
    request = b'{"input": {"prompt": "ten words of a prompt for a job to run on", "max_tokens": %d}}' % generated_tokens
    return b'{"operation_id": "' + op.encode() + b'", "request": ' + request + rest + b"}"


async def observe_until_final(runtime: Runtime, pool: asyncpg.Pool, op: str, *, due_now: bool, timeout_s: float) -> str:
    """Claim the operation's due polls and observe them until it is final; with ``due_now`` every poll is made
    due at once, otherwise each waits for the delay the observer chose."""
    observer = Observer(runtime)

    async def final() -> bool:
        if due_now:
            await pool.execute(
                "UPDATE operations SET next_poll_at = now() WHERE operation_id = $1 AND state IN "
                "('submitted', 'queued', 'running')",
                op,
            )
        for p in await runtime.ledger.claim_due_polls(100, 3.0):
            value = {
                "operation_id": p.operation_id,
                "remote_job_id": p.remote_job_id,
                "poll_claim_id": p.poll_claim_id,
                "claimed_at_ms": int(time.time() * 1000),
            }
            await observer.handle(RawMessage("polls", 0, 0, p.operation_id.encode(), orjson.dumps(value)))
        return await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = $1", op) in FINAL

    await wait_for(final, timeout_s, f"operation {op} to end")
    return str(await pool.fetchval("SELECT state::text FROM operations WHERE operation_id = $1", op))


OUTPUT_MEMBERS = (
    '{"seed": 18446744073709551616, "seed_plus_one": 18446744073709551617, '
    '"p": 0.1000000000000000055511151231257827, "big": 1e400, "negative": -9223372036854775809}'
)


async def test_big_integers_in_a_submission_and_an_output_arrive_exactly(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, simulator: Simulator
) -> None:
    await simulator.configure(output_extra_json=OUTPUT_MEMBERS, multi_output_rate=0.0)
    op = f"big-{uuid.uuid4().hex[:6]}"
    value = submission(op, b', "submitted_at_ms": 1, "source": {"n": 18446744073709551616, "m": 18446744073709551617}')
    await Dispatcher(runtime).handle(await through_kafka(settings, op, value))

    # the submission's numbers, in the ledger: the same integers (json text, as sent), not 18446744073709552000
    row = await runtime.ledger.get_operation(op)
    assert row is not None and row["state"] == "submitted"
    source = await pool.fetchval("SELECT source::text FROM operations WHERE operation_id = $1", op)
    assert source == '{"n": 18446744073709551616, "m": 18446744073709551617}'
    assert await pool.fetchval("SELECT source->>'n' FROM operations WHERE operation_id = $1", op) == (
        "18446744073709551616"
    )

    assert await observe_until_final(runtime, pool, op, due_now=True, timeout_s=15) == "succeeded"
    while await OutboxRelay(runtime).tick():
        pass
    delivered = [r for r in await read_topic_to_end(settings, "outputs_delivered") if r.value["operation_id"] == op]
    assert [r.value["output_id"] for r in delivered] == ["out_0"]  # one output, delivered once
    for record in delivered:
        # the bytes on generation.outputs.delivered: every number as the API wrote it (jsonb writes 1e400 in
        # plain digits: the same number)
        assert b'"seed": 18446744073709551616' in record.raw
        assert b'"seed_plus_one": 18446744073709551617' in record.raw
        assert b'"p": 0.1000000000000000055511151231257827' in record.raw
        assert b'"big": 1' + b"0" * 400 + b"," in record.raw
        assert b'"negative": -9223372036854775809' in record.raw
        assert b"18446744073709552000" not in record.raw and b"e+19" not in record.raw.lower()
        output = record.value["output"]
        assert (output["seed"], output["seed_plus_one"], output["negative"]) == (2**64, 2**64 + 1, -(2**63) - 1)
        assert str(output["p"]) == "0.1000000000000000055511151231257827"
        assert output["big"] == 10**400


async def test_numbers_that_cannot_be_carried_are_dead_lettered_with_their_reason(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, simulator: Simulator
) -> None:
    tag = uuid.uuid4().hex[:6]
    cases: list[tuple[bytes, str, str]] = [
        (
            b', "submitted_at_ms": 18446744073709551616',
            "schema",
            "at submitted_at_ms: 18446744073709551616 is greater than the maximum of 253402300799999",
        ),
        (b', "submitted_at_ms": 1, "source": {"n": NaN}', "not_json", "at source/n: NaN is not a JSON number"),
        (b', "submitted_at_ms": 1, "source": {"n": Infinity}', "not_json", "at source/n: Infinity is not a JSON"),
        (b', "submitted_at_ms": 1, "source": {"n": 1e5000}', "number_out_of_range", "at source/n: 1e5000 has 5001"),
        (b', "submitted_at_ms": 1e20', "schema", "at submitted_at_ms: 1E+20 is greater than the maximum"),
    ]
    sent: dict[str, tuple[bytes, str, str]] = {}
    for i, (rest, reason, words) in enumerate(cases):
        op = f"bad-{tag}-{i}"
        value = submission(op, rest)
        await Dispatcher(runtime).handle(await through_kafka(settings, op, value))
        sent[op] = (value, reason, words)
    letters = {
        base64.b64decode(r.value["key_base64"]).decode(): r.value
        for r in await read_topic_to_end(settings, "dead_letter")
        if r.value["key_base64"] and base64.b64decode(r.value["key_base64"]).decode().startswith(f"bad-{tag}-")
    }
    assert sorted(letters) == sorted(sent)
    for op, (value, reason, words) in sent.items():
        assert (letters[op]["reason"], base64.b64decode(letters[op]["original_base64"])) == (reason, value)
        assert words in letters[op]["error"]
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE operation_id LIKE $1", f"bad-{tag}-%") == 0
    assert (await simulator.get("/_sim/summary"))["posts"] == 0


async def test_a_nan_in_a_remote_output_is_a_contract_violation_naming_the_field(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, simulator: Simulator
) -> None:
    await simulator.configure(output_extra_json='{"score": NaN}')
    op = f"nan-{uuid.uuid4().hex[:6]}"
    await Dispatcher(runtime).handle(await through_kafka(settings, op, submission(op, b', "submitted_at_ms": 1')))
    assert await observe_until_final(runtime, pool, op, due_now=True, timeout_s=15) == "failed"
    reason = await pool.fetchval("SELECT reason FROM operations WHERE operation_id = $1", op)
    assert "contract_violation" in reason
    assert "at outputs/0/score: NaN is not a JSON number" in reason
    outcomes = await pool.fetch("SELECT outcome FROM remote_calls WHERE operation_id = $1 AND method = 'GET'", op)
    assert outcomes[-1]["outcome"] == "contract_violation"
    assert await pool.fetchval("SELECT count(*) FROM outputs WHERE operation_id = $1", op) == 0


@pytest.mark.parametrize("header", ["nan", "1e999"])
async def test_an_unreadable_retry_after_on_a_get_never_stops_the_polling(
    runtime: Runtime, pool: asyncpg.Pool, settings: Settings, simulator: Simulator, header: str
) -> None:
    """Every GET answer carries the header; the observer falls back to the answer's poll_after_ms and the job
    is polled again until it completes (no fixed sleep: each poll waits for the delay the observer chose)."""
    await simulator.configure(retry_after_header=header, compression=1.0)
    op = f"ra-{uuid.uuid4().hex[:6]}"
    # about 0.2 s queued + 20 tokens * 25 ms decoding: the first GETs see it unfinished
    value = submission(op, b', "submitted_at_ms": 1', generated_tokens=20)
    await Dispatcher(runtime).handle(await through_kafka(settings, op, value))
    await pool.execute("UPDATE operations SET next_poll_at = now() WHERE operation_id = $1", op)  # GET it early
    assert await observe_until_final(runtime, pool, op, due_now=False, timeout_s=20) == "succeeded"
    job = (await simulator.get(f"/_sim/operations/{op}"))["jobs"][0]
    assert job["gets"] >= 2 and job["terminal_gets"] == 1  # GETs happened after the unreadable hint, to the end
    gets = await pool.fetch(
        "SELECT outcome FROM remote_calls WHERE operation_id = $1 AND method = 'GET' ORDER BY id", op
    )
    assert [g["outcome"] for g in gets][-1] == "succeeded" and len(gets) == job["gets"]


@pytest.mark.parametrize(
    ("header", "retry_after_s"), [("nan", 1.0), ("1e999", 1.0), ("-1", 1.0), ("86400000", 3600.0), ("7", 7.0)]
)
async def test_retry_after_of_a_429_to_a_post_is_read_by_the_same_parser(
    runtime: Runtime, simulator: Simulator, header: str, retry_after_s: float
) -> None:
    await simulator.configure(fault_429=1.0, retry_after_header=header)
    with pytest.raises(RemoteRateLimitedError) as info:
        await runtime.remote.submit(f"ra429-{uuid.uuid4().hex[:6]}", '{"input": {"prompt": "p", "max_tokens": 1}}')
    assert info.value.retry_after_s == retry_after_s
