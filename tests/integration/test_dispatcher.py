"""The dispatcher against real PostgreSQL, Redis, Kafka and the simulator: the POST outcome taxonomy."""

from __future__ import annotations

import asyncio
import socket
import time
from decimal import Decimal
from typing import Any

import asyncpg
import orjson
import pytest

from streams.config import Settings
from streams.wire import exactjson
from streams.worker.runtime import RawMessage, Runtime, SendFn
from streams.worker.stages.dispatcher import Dispatcher
from streams_harness.simulator import SimulatorConfig
from streams_harness.simulator.model import prompt_tokens
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration


def request_text(generated: int = 20, model: str | None = None) -> str:
    """A provider request: a 100-token prompt, ``generated`` tokens to generate."""
    request: dict[str, Any] = {"input": {"prompt": " ".join(["lease"] * 100), "max_tokens": generated}}
    if model is not None:
        request["model"] = model
    return orjson.dumps(request).decode()


def submission(op: str, generated: int = 20, request: str | None = None) -> RawMessage:
    """A submission event whose request is the JSON text ``request`` (written into the value as it is)."""
    text = request if request is not None else request_text(generated)
    value = f'{{"operation_id": "{op}", "request": {text}, "submitted_at_ms": {int(time.time() * 1000)}}}'
    return RawMessage("generation.submissions", 0, 1, op.encode(), value.encode())


async def op_row(pool: asyncpg.Pool, op: str) -> asyncpg.Record:
    row = await pool.fetchrow(
        "SELECT state::text AS state, remote_job_id, reason, reason_code FROM operations WHERE operation_id=$1", op
    )
    assert row is not None
    return row


async def test_created_job_is_saved_and_replay_does_not_post_again(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    d = Dispatcher(runtime)
    await d.handle(submission("op-ok"))
    await d.handle(submission("op-ok"))  # Kafka redelivery
    row = await op_row(pool, "op-ok")
    record = await simulator.get("/_sim/operations/op-ok")
    assert record["posts"] == 1 and len(record["jobs"]) == 1
    assert row["state"] == "submitted" and row["remote_job_id"] == record["jobs"][0]["job_id"]
    states = [
        r["to_state"]
        for r in await pool.fetch("SELECT to_state::text FROM transitions WHERE operation_id='op-ok' ORDER BY id")
    ]
    assert states == ["accepted", "submitting", "submitted"]
    calls = await pool.fetch("SELECT method, outcome, status_code FROM remote_calls WHERE operation_id='op-ok'")
    assert [(c["method"], c["outcome"], c["status_code"]) for c in calls] == [("POST", "created", 201)]


async def test_502_with_job_id_saves_that_job(runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator) -> None:
    await simulator.configure(fault_502_job_id=1.0)
    await Dispatcher(runtime).handle(submission("op-502"))
    record = await simulator.get("/_sim/operations/op-502")
    row = await op_row(pool, "op-502")
    assert record["posts"] == 1
    assert row["state"] == "submitted" and row["remote_job_id"] == record["jobs"][0]["job_id"]
    assert row["reason_code"] == "job_id_via_error" and row["reason"] == "job id from HTTP 502 error.job_id"


@pytest.mark.parametrize(
    ("fault", "reason_part"),
    [
        ({"fault_5xx": 1.0}, "without error.job_id"),
        ({"fault_drop_after_create": 1.0}, "connection lost after send"),
        ({"fault_slow": 1.0, "slow_response_s": 4.0}, "timed out after send"),
    ],
)
async def test_unknown_outcomes_end_uncertain_without_second_post(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, fault: dict[str, float], reason_part: str
) -> None:
    await simulator.configure(**fault)
    await Dispatcher(runtime).handle(submission("op-u"))
    row = await op_row(pool, "op-u")
    assert row["state"] == "uncertain"
    assert reason_part in row["reason"] and row["reason_code"] == "unknown_outcome"
    assert (await simulator.get("/_sim/operations/op-u"))["posts"] == 1


async def test_429_is_retried_after_retry_after_and_creates_one_job(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    await simulator.configure(fault_429=1.0, retry_after_s=1)
    task = asyncio.create_task(Dispatcher(runtime).handle(submission("op-429")))

    async def posted() -> bool:
        posts: int = (await simulator.get("/_sim/operations/op-429"))["posts"]
        return posts >= 1

    await wait_for(posted, 10, "the first POST (answered 429)")
    await simulator.configure(fault_429=0.0)
    await asyncio.wait_for(task, 10)
    record = await simulator.get("/_sim/operations/op-429")
    assert record["post_statuses"][0] == 429 and record["post_statuses"][-1] == 201
    assert len(record["jobs"]) == 1
    assert (await op_row(pool, "op-429"))["state"] == "submitted"


async def test_connection_refused_is_retried_and_exactly_one_job_exists(
    settings: Settings, pool: asyncpg.Pool, kafka_send: SendFn
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rt = await Runtime.create(settings.replace(remote_base_url=f"http://127.0.0.1:{port}"), kafka_send, "w")
    late = Simulator()
    try:
        task = asyncio.create_task(Dispatcher(rt).handle(submission("op-refused")))

        async def refused_attempts() -> int:
            return int(
                await pool.fetchval(
                    "SELECT count(*) FROM remote_calls WHERE operation_id='op-refused' AND outcome='not_sent'"
                )
            )

        async def refused_twice() -> bool:
            return await refused_attempts() >= 2

        await wait_for(refused_twice, 10, "two refused connection attempts")
        await late.start(SimulatorConfig(port=port, compression=100.0))
        await asyncio.wait_for(task, 15)
        record = await late.get("/_sim/operations/op-refused")
        assert record["posts"] == 1 and len(record["jobs"]) == 1
        assert (await op_row(pool, "op-refused"))["state"] == "submitted"
    finally:
        await rt.close()
        await late.stop()


async def test_definite_refusal_ends_rejected(runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator) -> None:
    # The simulator refuses max_tokens 0 with 400 invalid_request: nothing is created (the product does not look
    # inside the request: the provider decides).
    await Dispatcher(runtime).handle(submission("op-400", generated=0))
    row = await op_row(pool, "op-400")
    assert row["state"] == "rejected" and "HTTP 400 invalid_request" in row["reason"]
    assert row["reason_code"] == "refused"
    assert "max_tokens" in row["reason"]
    record = await simulator.get("/_sim/operations/op-400")
    assert (record["post_statuses"], record["jobs"]) == ([400], [])


#: A request whose numbers orjson or a double would change and whose strings carry escapes and non-ASCII text.
EXACT_REQUEST = (
    '{"model": "genace-1", "input": {"prompt": "Write a haiku about leases \\u00e9\\n\\"\\\\\\u0000'
    ' \\ud83d\\ude00 h\\u00e9 \u00e9 \u2603 \U0001f600", "max_tokens": 32}, "seed": 18446744073709551617,'
    ' "t": 0.1000000000000000055511151231257827, "huge": 1e400, "trail": 1.50, "metadata": {"user": "u-1"}}'
)


async def test_the_request_reaches_the_provider_exactly(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator
) -> None:
    """The bytes the provider receives are the submitted request text, with the client reference added inside
    its metadata; the ledger keeps the text as it was submitted."""
    await simulator.configure(record_bodies=True)
    await Dispatcher(runtime).handle(submission("op-exact", request=EXACT_REQUEST))
    record = await simulator.get("/_sim/operations/op-exact")
    assert record["post_statuses"] == [201]
    [body] = record["bodies"]
    assert body == EXACT_REQUEST.replace('{"user": "u-1"}', '{"user": "u-1","client_reference":"op-exact"}')
    received = exactjson.loads(body)
    assert received["seed"] == 2**64 + 1
    assert received["t"] == Decimal("0.1000000000000000055511151231257827")
    assert received["huge"] == Decimal("1e400")
    prompt = 'Write a haiku about leases \u00e9\n"\\\x00 \U0001f600 h\u00e9 \u00e9 \u2603 \U0001f600'
    assert received["input"]["prompt"] == prompt
    [job] = record["jobs"]
    assert (job["context_tokens"], job["generated_tokens"]) == (prompt_tokens(prompt), 32) == (14, 32)
    stored = await pool.fetchval("SELECT request::text FROM operations WHERE operation_id = 'op-exact'")
    assert stored == EXACT_REQUEST
    assert (await op_row(pool, "op-exact"))["state"] == "submitted"


async def test_model_default_is_added_only_when_absent(runtime: Runtime, simulator: Simulator) -> None:
    await simulator.configure(record_bodies=True)
    d = Dispatcher(runtime)
    await d.handle(submission("op-default", request=request_text()))
    await d.handle(submission("op-own-model", request=request_text(model="genace-1")))
    [default] = (await simulator.get("/_sim/operations/op-default"))["jobs"]
    [own] = (await simulator.get("/_sim/operations/op-own-model"))["jobs"]
    assert (default["model"], own["model"]) == (runtime.settings.remote_model, "genace-1")


async def test_a_refusal_quoting_the_prompt_keeps_it_out_of_the_reason_and_the_log(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, caplog: pytest.LogCaptureFixture
) -> None:
    """The simulator's 400 quotes the refused value, as providers do: that text became the operation's reason (a log
    line, the transitions topic, the live view) with the prompt in it."""
    secret = "MY-PRIVATE-PROMPT-TEXT-3"
    await Dispatcher(runtime).handle(submission("op-echo", request=f'{{"input": "{secret}"}}'))
    row = await op_row(pool, "op-echo")
    assert row["state"] == "rejected" and row["reason_code"] == "refused"
    assert row["reason"].endswith(
        "refused with HTTP 400 invalid_request: at input: '<request text>' is not of type 'object'"
    )
    assert secret not in caplog.text and "<request text>" in caplog.text
