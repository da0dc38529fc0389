"""The pipeline (dispatcher, observer, ledger, outbox) against the simulator in each provider dialect."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import asyncpg
import orjson
import pytest

from streams.config import Settings
from streams.errors import ConfigError
from streams.model.codes import ReasonCode
from streams.model.states import OperationState
from streams.remote.client import RemoteClient
from streams.remote.dialect import DIALECTS_PACKAGE
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.dispatcher import Dispatcher
from streams.worker.stages.observer import Observer
from streams.worker.stages.reconciler import Reconciler
from streams_harness.simulator import SimulatorConfig
from tests.support import SimulatorServer as Simulator
from tests.support import wait_for

pytestmark = pytest.mark.integration

REQUEST = '{"input": {"prompt": "ten words of a prompt for a job to run on", "max_tokens": 5}}'
#: Dialect -> the output ids its answers become (seed: the provider's ids; predictions: positions).
OUTPUT_IDS = {"seed-generations": ["out_0", "out_1"], "replicate-predictions": ["output_0", "output_1"]}


@pytest.fixture(params=sorted(OUTPUT_IDS))
def dialect(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
async def simulator(dialect: str) -> AsyncIterator[Simulator]:
    """The simulator serving ``dialect``, every succeeded job with two outputs, 100x compressed."""
    sim = Simulator()
    await sim.start(
        SimulatorConfig(port=0, compression=100.0, get_latency_ms=1.0, multi_output_rate=1.0, dialect=dialect)
    )
    yield sim
    await sim.stop()


@pytest.fixture
def settings(migrated: Settings, simulator: Simulator, dialect: str, tmp_path: Path) -> Settings:
    """The simulator's URL, a fresh Redis key prefix and ``dialect``; the prediction API's as a file holding its
    create answers 1 s (``Prefer: wait=1``: the tier's call deadline is shorter than the shipped 5 s)."""
    chosen = dialect
    if dialect == "replicate-predictions":
        declaration = json.loads(resources.files(DIALECTS_PACKAGE).joinpath(f"{dialect}.json").read_text())
        declaration["create"]["headers"] = {"Prefer": "wait=1"}
        chosen = str(tmp_path / "predictions.json")
        Path(chosen).write_text(json.dumps(declaration))
    return migrated.replace(
        remote_base_url=simulator.url, lease_key_prefix=f"t{uuid.uuid4().hex[:8]}", provider_dialect=chosen
    )


def submission(op: str) -> RawMessage:
    request = '{"input": {"prompt": "ten words of a prompt for a job to run on", "max_tokens": 5}}'
    value = f'{{"operation_id": "{op}", "request": {request}, "submitted_at_ms": {int(time.time() * 1000)}}}'
    return RawMessage("generation.submissions", 0, 1, op.encode(), value.encode())


async def claim_poll(runtime: Runtime, op: str) -> RawMessage | None:
    polls = [p for p in await runtime.ledger.claim_due_polls(100, 3.0) if p.operation_id == op]
    if not polls:
        return None
    p = polls[0]
    value = {
        "operation_id": op,
        "remote_job_id": p.remote_job_id,
        "poll_claim_id": p.poll_claim_id,
        "claimed_at_ms": int(time.time() * 1000),
    }
    return RawMessage("generation.polls", 0, 0, op.encode(), orjson.dumps(value))


async def test_a_submission_runs_to_delivered_outputs_in_each_dialect(
    runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, dialect: str
) -> None:
    op = f"op-dialect-{dialect}"
    await Dispatcher(runtime).handle(submission(op))
    record = await simulator.get(f"/_sim/operations/{op}")
    assert record["posts"] == 1 and len(record["jobs"]) == 1
    job_id = record["jobs"][0]["job_id"]
    observer = Observer(runtime)

    async def state() -> str:
        return str(await pool.fetchval("SELECT state::text FROM operations WHERE operation_id=$1", op))

    async def succeeded() -> bool:
        await pool.execute(
            "UPDATE operations SET next_poll_at = now()"
            " WHERE operation_id=$1 AND state IN ('submitted','queued','running')",
            op,
        )
        if await state() != "succeeded":
            event = await claim_poll(runtime, op)
            if event is not None:
                await observer.handle(event)
        return await state() == "succeeded"

    await wait_for(succeeded, 20, f"operation to succeed ({dialect})")
    assert await pool.fetchval("SELECT remote_job_id FROM operations WHERE operation_id=$1", op) == job_id
    outputs = await pool.fetch("SELECT output_id FROM outputs WHERE operation_id=$1 ORDER BY position", op)
    assert [r["output_id"] for r in outputs] == OUTPUT_IDS[dialect]
    outbox = await pool.fetch(
        "SELECT event_id FROM outbox WHERE operation_id=$1 AND topic_role='outputs_delivered' ORDER BY id", op
    )
    assert [r["event_id"] for r in outbox] == [f"output:{op}:{i}" for i in OUTPUT_IDS[dialect]]
    calls = await pool.fetch("SELECT method, outcome, status_code FROM remote_calls WHERE operation_id=$1", op)
    assert (calls[0]["method"], calls[0]["outcome"], calls[0]["status_code"]) == ("POST", "created", 201)
    assert all(c["method"] == "GET" and c["status_code"] == 200 for c in calls[1:]) and len(calls) >= 2
    sim_job = (await simulator.get(f"/_sim/operations/{op}"))["jobs"][0]
    assert sim_job["gets"] == len(calls) - 1 and sim_job["max_gets_in_flight"] == 1


async def test_without_a_declared_lookup_an_uncertain_operation_waits_for_an_operator(
    settings: Settings, runtime: Runtime, pool: asyncpg.Pool, simulator: Simulator, dialect: str
) -> None:
    """The seed declares the lookup, the predictions API none: a worker with the lookup on refuses to start with
    the latter; with it off the reconciler looks nothing up and the operation stays ``uncertain`` for a person."""
    with_lookup = settings.replace(lookup_enabled=True, lookup_lag_s=0.0)
    if dialect == "seed-generations":
        await RemoteClient.from_settings(with_lookup).aclose()
        return
    with pytest.raises(ConfigError, match=r"STREAMS_LOOKUP_ENABLED is on .*declares no lookup by client reference"):
        RemoteClient.from_settings(with_lookup)
    op = f"op-nolookup-{uuid.uuid4().hex[:6]}"
    assert await runtime.ledger.accept(op, REQUEST, submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit(op)
    assert fencing is not None
    assert await runtime.ledger.save_submission_without_job(
        op, fencing, OperationState.UNCERTAIN, "connection lost after send", ReasonCode.UNKNOWN_OUTCOME
    )
    assert await Reconciler(runtime).tick() == 0
    row = await pool.fetchrow(
        "SELECT state::text AS state, fencing_token, next_lookup_at FROM operations WHERE operation_id=$1", op
    )
    assert (row["state"], row["fencing_token"], row["next_lookup_at"]) == ("uncertain", fencing, None)
    assert (await simulator.get("/_sim/summary"))["lookups"] == 0
