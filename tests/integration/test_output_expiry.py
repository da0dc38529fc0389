"""Outputs that expire: the provider's expiry (or the settings' default) carried by the delivered event, validated
by its schema, and an output delivered too close to it counted and logged."""

from __future__ import annotations

import logging
import time
import uuid

import pytest

from streams import metrics
from streams.clients.follow import read_topic_to_end
from streams.config import Settings
from streams.ledger.records import SaveOutcome
from streams.model.answers import JobSnapshot
from streams.model.states import OperationState
from streams.remote.client import RemoteClient
from streams.wire import contracts, exactjson
from streams.worker.runtime import Runtime
from streams.worker.stages.relay import OutboxRelay
from tests.integration.test_relay_and_dead_letters import for_op
from tests.support import SimulatorServer as Simulator

pytestmark = pytest.mark.integration


async def succeed_with(runtime: Runtime, op: str, snap: JobSnapshot) -> None:
    assert await runtime.ledger.accept(op, '{"input": {"prompt": "p", "max_tokens": 1}}', submitted_at_ms=0)
    fencing = await runtime.ledger.claim_for_submit(op)
    assert fencing is not None
    assert await runtime.ledger.save_submitted(op, fencing, snap.job_id, 0.0, None)
    polls = [p for p in await runtime.ledger.claim_due_polls(1000, 3.0) if p.operation_id == op]
    claim = await runtime.ledger.claim_for_observe(op, polls[0].poll_claim_id)
    assert claim is not None
    assert await runtime.ledger.save_observation(op, claim.fencing_token, snap, None) is SaveOutcome.SAVED


async def test_the_delivered_event_carries_the_expiry_and_one_near_it_is_counted(
    runtime: Runtime, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    op = f"op-expiry-{uuid.uuid4().hex[:6]}"
    now_ms = int(time.time() * 1000)
    soon_ms, later_ms = now_ms + 60_000, now_ms + 86_400_000  # 1 min (margin: 10 min) and a day
    snap = JobSnapshot(
        f"job-{op}",
        "succeeded",
        OperationState.SUCCEEDED,
        outputs=[{"id": "out_0"}, {"id": "out_1"}, {"id": "out_2"}],
        completed_at_ms=now_ms,
        output_expires_at_ms=(soon_ms, later_ms, None),
    )
    await succeed_with(runtime, op, snap)
    before = metrics.OUTPUTS_NEAR_EXPIRY._value.get()
    with caplog.at_level(logging.WARNING, "streams.worker.stages.relay"):
        await OutboxRelay(runtime).tick()
    assert metrics.OUTPUTS_NEAR_EXPIRY._value.get() - before == 1  # out_0 only
    warned = [r.getMessage() for r in caplog.records if "before it expires" in r.getMessage()]
    assert len(warned) == 1 and f"output:{op}:out_0" in warned[0]
    events = {o["output_id"]: o for o in for_op(await read_topic_to_end(settings, "outputs_delivered"), op)}
    assert events["out_0"]["expires_at_ms"] == soon_ms and events["out_1"]["expires_at_ms"] == later_ms
    assert "expires_at_ms" not in events["out_2"]  # unknown: absent, the event as before
    for event in events.values():
        contracts.decode("generation.outputs.delivered", exactjson.dumps(event), settings.max_value_bytes)


async def test_expiry_from_the_answer_or_the_default_after_completion(settings: Settings, simulator: Simulator) -> None:
    """The simulator's outputs carry ``expires_at`` (unix s): read as given; without it, completion plus
    ``remote_output_ttl_s``."""
    await simulator.configure(output_ttl_s=3600.0)
    given = RemoteClient.from_settings(settings)
    default = RemoteClient.from_settings(settings.replace(remote_output_ttl_s=600.0))
    try:
        job = await given.submit("op-exp-1", '{"input": {"prompt": "p", "max_tokens": 1}}')
        while (snap := await given.observe("op-exp-1", job.job_id)).state is not OperationState.SUCCEEDED:
            assert snap.state in (OperationState.QUEUED, OperationState.RUNNING)
        record = (await simulator.get("/_sim/operations/op-exp-1"))["jobs"][0]
        assert snap.output_expires_at_ms == (int((record["completed_at"] + 3600.0) * 1000),) * record["outputs"]
        await simulator.configure(output_ttl_s=0.0)
        plain = await default.observe("op-exp-1", job.job_id)
        assert plain.completed_at_ms is not None
        assert plain.output_expires_at_ms == (plain.completed_at_ms + 600_000,) * record["outputs"]
    finally:
        await given.aclose()
        await default.aclose()
