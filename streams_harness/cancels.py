"""A harness run's cancellations and completion callbacks (docs/cancellation.md, docs/callbacks.md).

* :func:`cancellation_plan`: which operations of a replay are canceled and when, seeded; some at their submission
  (before their POST, or while it is on the wire), the others staggered while their jobs run;
* :func:`publish_cancellations`: the plan's messages on the run's ``generation.cancellations`` topic, each at its
  time;
* :func:`callback_secret` and :func:`callback_refusals`: the run's test secret, and the refusals the workers
  counted by reason (``streams_callbacks_refused_total{reason}`` of their ``/metrics``).
"""

from __future__ import annotations

import asyncio
import base64
import random
import secrets
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import httpx
import orjson
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from streams.config import Settings
from streams.kafka_security import producer_kwargs
from streams.wire import contracts
from streams_harness.trace import TraceRow

#: Share of a plan's cancellations sent at their operation's submission (before the POST, or racing it).
AT_SUBMISSION_SHARE = 0.4
#: Latest a staggered cancellation follows its submission, in the trace's seconds (divided by the compression);
#: the trace's jobs last up to a minute, so most are still running then.
STAGGER_MAX_TRACE_S = 20.0
#: Who the run's cancellations say asked (recorded in the ledger's ``cancellations``).
REQUESTED_BY = "streams-harness"
#: The metric whose samples :func:`callback_refusals` sums (docs/callbacks.md).
REFUSED_METRIC = "streams_callbacks_refused_total"


@dataclass(frozen=True)
class PlannedCancel:
    """One cancellation of a run: the operation and when it is sent, in s from the start of the replay."""

    at_s: float
    operation_id: str


def cancellation_plan(
    rows: Sequence[TraceRow], operation_ids: Sequence[str], *, fraction: float, compression: float, seed: int
) -> list[PlannedCancel]:
    """A seeded ``fraction`` (0..1) of ``rows`` (whose operation ids are ``operation_ids``, in the same order) to
    cancel, in order of sending: a share :data:`AT_SUBMISSION_SHARE` at the row's arrival (its POST is not sent
    yet, or is racing the cancel), the others a random part of :data:`STAGGER_MAX_TRACE_S` later (their jobs
    running); times are the trace's divided by ``compression``. At least one when ``fraction`` > 0 and there are
    rows."""
    if fraction <= 0 or not rows:
        return []
    rng = random.Random(seed ^ 0xCA5CE1)
    count = max(1, round(fraction * len(rows)))
    chosen = sorted(rng.sample(range(len(rows)), min(count, len(rows))))
    plan = []
    for index in chosen:
        lag_s = 0.0 if rng.random() < AT_SUBMISSION_SHARE else rng.uniform(0.5, STAGGER_MAX_TRACE_S)
        plan.append(PlannedCancel((rows[index].arrival_s + lag_s) / compression, operation_ids[index]))
    return sorted(plan, key=lambda c: c.at_s)


def cancellation(operation_id: str, *, reason: str = "harness run: canceled by plan") -> bytes:
    """A ``generation.cancellations`` value for ``operation_id``, checked against its schema.

    Raises:
        InvalidEventError: the value does not satisfy the schema (an operation id the schema refuses).
    """
    value = orjson.dumps(
        {
            "operation_id": operation_id,
            "reason": reason,
            "requested_by": REQUESTED_BY,
            "requested_at_ms": int(time.time() * 1000),
        }
    )
    contracts.decode("generation.cancellations", value, 1024)
    return value


async def publish_cancellations(settings: Settings, plan: Iterable[PlannedCancel], started: float) -> int:
    """Send each cancellation of ``plan`` at ``started`` (a :func:`time.monotonic` value) + its ``at_s``, keyed by
    its operation id, on ``settings``' ``cancellations`` topic; returns how many were acknowledged.

    Raises:
        KafkaError: a send failed (the idempotent producer's own retries spent).
    """
    producer = AIOKafkaProducer(**producer_kwargs(settings))
    await producer.start()
    sent = 0
    try:
        for cancel in plan:
            delay_s = started + cancel.at_s - time.monotonic()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            await producer.send_and_wait(
                settings.topic("cancellations"), cancellation(cancel.operation_id), key=cancel.operation_id.encode()
            )
            sent += 1
    finally:
        await producer.stop()
    return sent


def callback_secret() -> str:
    """A fresh Standard Webhooks test secret, ``whsec_<base64 of 24 random bytes>``, for one run."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


async def callback_refusals(worker_urls: Iterable[str]) -> dict[str, int]:
    """The callbacks refused by reason, summed over the workers at ``worker_urls`` (``http://host:port``: their
    ``/metrics``); a worker that does not answer is left out (its counts died with it)."""
    counts: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=5.0) as client:
        for url in worker_urls:
            try:
                answer = await client.get(f"{url}/metrics")
                answer.raise_for_status()
            except httpx.HTTPError:
                continue
            for family in text_string_to_metric_families(answer.text):
                for sample in family.samples:
                    if sample.name == REFUSED_METRIC and sample.value:
                        counts[sample.labels.get("reason", "unknown")] += int(sample.value)
    return dict(sorted(counts.items()))
