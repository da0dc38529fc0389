"""A harness run's cancellations and completion callbacks (docs/cancellation.md, docs/callbacks.md).

* :func:`cancellation_plan`: which operations of a replay are canceled and when, seeded; some at their submission
  (before their POST), the others staggered while their jobs run;
* :func:`publish_cancellations`: the plan's messages on the run's ``generation.cancellations`` topic, each at its
  time (a while-running one once the ledger shows its job id saved);
* :func:`callback_secret` and :func:`callback_refusals`: the run's test secret, and the refusals the workers
  counted by reason (``streams_callbacks_refused_total{reason}`` of their ``/metrics``).
"""

from __future__ import annotations

import asyncio
import base64
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import orjson

from streams.config import Settings
from streams.kafka_security import new_producer
from streams.outages import is_outage
from streams.wire import contracts
from streams_harness.fleet import worker_counter_sums
from streams_harness.trace import TraceRow

#: Share of a plan's cancellations sent at their operation's submission (before the POST, often before the
#: worker has even accepted the submission); the others are sent while the job runs.
AT_SUBMISSION_SHARE = 0.4
#: The kinds of cancellation a plan holds.
AT_SUBMISSION = "at_submission"
WHILE_RUNNING = "while_running"
#: Latest extra wait of a while-running cancellation after its job id was saved, in the trace's seconds (divided by
#: the compression): staggered, so some reach a job just created and some a job about to end.
STAGGER_MAX_TRACE_S = 10.0
#: States in which a while-running cancellation is not sent yet: the operation has no job id saved.
NOT_YET_RUNNING = frozenset({"missing", "accepted", "submitting"})
#: Pause between two reads of the states of the while-running cancellations' operations (s).
STATE_POLL_INTERVAL_S = 0.05
#: Who the run's cancellations say asked (recorded in the ledger's ``cancellations``).
REQUESTED_BY = "streams-harness"
#: The metric whose samples :func:`callback_refusals` sums (docs/callbacks.md).
REFUSED_METRIC = "streams_callbacks_refused_total"

#: Reads the ledger states of operation ids (an id the ledger does not hold is left out).
StateReader = Callable[[list[str]], Awaitable[Mapping[str, str]]]


@dataclass(frozen=True)
class PlannedCancel:
    """One cancellation of a run: the operation, its ``kind`` (:data:`AT_SUBMISSION`: sent at ``at_s``, in s from
    the start of the replay; :data:`WHILE_RUNNING`: sent ``lag_s`` after the operation is first seen past
    ``submitting``, and not before ``at_s``)."""

    at_s: float
    operation_id: str
    kind: str = AT_SUBMISSION
    lag_s: float = 0.0


def cancellation_plan(
    rows: Sequence[TraceRow], operation_ids: Sequence[str], *, fraction: float, compression: float, seed: int
) -> list[PlannedCancel]:
    """A seeded ``fraction`` (0..1) of ``rows`` (whose operation ids are ``operation_ids``, in the same order) to
    cancel, by arrival: a share :data:`AT_SUBMISSION_SHARE` of any rows at the row's arrival (no POST sent yet),
    the others among the rows of the longest jobs (the most generated tokens: a quarter of the rows, or more when
    the fraction needs them) while their job runs, a random part of :data:`STAGGER_MAX_TRACE_S` after its job id
    was saved; times are the trace's divided by ``compression``. At least one when ``fraction`` > 0 and there are
    rows."""
    if fraction <= 0 or not rows:
        return []
    rng = random.Random(seed ^ 0xCA5CE1)
    count = min(len(rows), max(1, round(fraction * len(rows))))
    running = count - round(count * AT_SUBMISSION_SHARE)
    by_length = sorted(range(len(rows)), key=lambda i: (-rows[i].generated_tokens, i))
    longest = by_length[: max(running, len(rows) // 4)]
    while_running = set(rng.sample(longest, running))
    at_submission = set(rng.sample([i for i in range(len(rows)) if i not in while_running], count - running))
    plan = []
    for index in sorted(while_running | at_submission):
        at_s = rows[index].arrival_s / compression
        if index in at_submission:
            plan.append(PlannedCancel(at_s, operation_ids[index]))
        else:
            lag_s = rng.uniform(0.0, STAGGER_MAX_TRACE_S) / compression
            plan.append(PlannedCancel(at_s, operation_ids[index], WHILE_RUNNING, lag_s))
    return plan


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


async def publish_cancellations(
    settings: Settings, plan: Sequence[PlannedCancel], started: float, states: StateReader
) -> int:
    """Send each cancellation of ``plan``, keyed by its operation id, on ``settings``' ``cancellations`` topic:
    an :data:`AT_SUBMISSION` one at ``started`` (a :func:`time.monotonic` value) + its ``at_s``; a
    :data:`WHILE_RUNNING` one ``lag_s`` after ``states`` (read every :data:`STATE_POLL_INTERVAL_S`) first shows
    its operation past :data:`NOT_YET_RUNNING` (a job that ended meanwhile is still asked: recorded, nothing
    changes). A state read that fails with an outage is retried at the next interval. Returns how many were sent.

    Raises:
        KafkaError: a send failed (the idempotent producer's own retries spent); a state read's error that is not
            an outage.
    """
    producer = new_producer(settings)
    await producer.start()
    due: list[tuple[float, str]] = [(c.at_s, c.operation_id) for c in plan if c.kind == AT_SUBMISSION]
    waiting = {c.operation_id: c for c in plan if c.kind == WHILE_RUNNING}
    sent = 0
    try:
        while due or waiting:
            now_s = time.monotonic() - started
            watched = [op for op, c in waiting.items() if c.at_s <= now_s]
            if watched:
                try:
                    seen = await states(watched)
                except Exception as exc:
                    if not is_outage(exc):
                        raise
                    seen = {}
                for op in watched:
                    if seen.get(op, "missing") not in NOT_YET_RUNNING:
                        due.append((now_s + waiting.pop(op).lag_s, op))
            due.sort()
            while due and due[0][0] <= time.monotonic() - started:
                _, op = due.pop(0)
                await producer.send_and_wait(settings.topic("cancellations"), cancellation(op), key=op.encode())
                sent += 1
            until_next_s = due[0][0] - (time.monotonic() - started) if due else STATE_POLL_INTERVAL_S
            await asyncio.sleep(max(0.0, min(until_next_s, STATE_POLL_INTERVAL_S) if waiting else until_next_s))
    finally:
        await producer.stop()
    return sent


def callback_secret() -> str:
    """A fresh Standard Webhooks test secret, ``whsec_<base64 of 24 random bytes>``, for one run."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


async def callback_refusals(worker_urls: Iterable[str]) -> dict[str, int]:
    """The callbacks refused by reason, summed over the workers at ``worker_urls`` (``http://host:port``: their
    ``/metrics``); a worker that does not answer is left out (its counts died with it)."""
    return await worker_counter_sums(worker_urls, REFUSED_METRIC, "reason")
