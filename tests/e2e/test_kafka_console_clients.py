"""A client nobody here wrote: Kafka's own console producer submits what a generation API takes, a worker
process carries it to the provider simulator exactly, and Kafka's console consumer reads the outputs."""

from __future__ import annotations

import time
from decimal import Decimal

import asyncpg
import orjson
import pytest

from streams.clients.follow import read_topic_to_end
from streams.config import Settings
from streams.wire import exactjson
from streams_harness.fleet import Fleet
from tests.support import SimulatorServer, kafka_tool

pytestmark = pytest.mark.e2e

#: The request a generation API takes, as an application writes it.
HAIKU = '{"model": "genace-1", "input": {"prompt": "Write a haiku about leases", "max_tokens": 32}}'

#: Numbers orjson or a double would change; escapes and non-ASCII text (written as UTF-8 on the command line).
EXACT = (
    '{"input": {"prompt": "Caf\\u00e9 \\"lease\\" \\\\ \\ud83d\\ude00 h\u00e9 \u2603 \U0001f600", "max_tokens": 3},'
    ' "seed": 18446744073709551617, "t": 0.1000000000000000055511151231257827, "scale": 1e400,'
    ' "metadata": {"user": "u-\u00e9"}}'
)


async def test_console_producer_to_console_consumer(
    fleet: Fleet, fault_settings: Settings, sim: SimulatorServer, ledger_pool: asyncpg.Pool
) -> None:
    await sim.configure(record_bodies=True, multi_output_rate=0.0)
    fleet.start("w1")
    await fleet.wait_ready()
    run = fault_settings.lease_key_prefix
    requests = {f"{run}-haiku": HAIKU, f"{run}-exact": EXACT}
    now_ms = int(time.time() * 1000)
    lines = "".join(
        f'{op}\t{{"operation_id": "{op}", "request": {text}, "submitted_at_ms": {now_ms}}}\n'
        for op, text in requests.items()
    )
    await kafka_tool(
        "org.apache.kafka.tools.ConsoleProducer",
        "--bootstrap-server",
        fault_settings.kafka_bootstrap,
        "--topic",
        fault_settings.topic("submissions"),
        "--reader-property",
        "parse.key=true",
        stdin=lines.encode("utf-8"),
    )

    consumed = await kafka_tool(
        "org.apache.kafka.tools.consumer.ConsoleConsumer",
        "--bootstrap-server",
        fault_settings.kafka_bootstrap,
        "--topic",
        fault_settings.topic("outputs_delivered"),
        "--from-beginning",
        "--max-messages",
        str(len(requests)),
        "--timeout-ms",
        "60000",
    )
    outputs = {value["operation_id"]: value for value in map(orjson.loads, consumed.splitlines())}
    assert set(outputs) == set(requests), consumed
    haiku = outputs[f"{run}-haiku"]
    assert (haiku["output_id"], haiku["output"]["tokens"]) == ("out_0", 32)
    assert haiku["remote_job_id"].startswith("job_")

    states = {
        r["operation_id"]: (r["state"], r["request"])
        for r in await ledger_pool.fetch("SELECT operation_id, state::text AS state, request::text FROM operations")
    }
    assert states == {op: ("succeeded", text) for op, text in requests.items()}

    # What reached the provider: the request as written, plus only the client reference.
    haiku_record = await sim.get(f"/_sim/operations/{run}-haiku")
    assert haiku_record["bodies"] == [HAIKU[:-1] + f',"metadata":{{"client_reference":"{run}-haiku"}}}}']
    assert (haiku_record["jobs"][0]["model"], haiku_record["jobs"][0]["context_tokens"]) == ("genace-1", 5)
    [exact_body] = (await sim.get(f"/_sim/operations/{run}-exact"))["bodies"]
    with_reference = EXACT.replace('"u-\u00e9"}', f'"u-\u00e9","client_reference":"{run}-exact"}}')
    assert exact_body == with_reference[:-1] + f',"model":"{fault_settings.remote_model}"}}'
    received = exactjson.loads(exact_body)
    assert received["seed"] == 2**64 + 1
    assert received["t"] == Decimal("0.1000000000000000055511151231257827")
    assert received["scale"] == Decimal("1e400")
    assert received["input"]["prompt"] == 'Caf\u00e9 "lease" \\ \U0001f600 h\u00e9 \u2603 \U0001f600'
    assert received["model"] == fault_settings.remote_model  # the default, since the request names none

    assert await read_topic_to_end(fault_settings, "dead_letter") == []
