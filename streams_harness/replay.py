"""Trace replay: publish trace rows as submissions at their (compressed) arrival times."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

from streams.clients.submit import SubmissionProducer
from streams_harness.trace import TraceRow

#: Words of the replay's prompts (short ones: a prompt of the trace's longest context, 14,050 tokens, is ~68 KB).
PROMPT_WORDS = ("the", "lease", "holds", "while", "a", "worker", "polls", "one", "job", "and", "saves", "it")


def trace_prompt(tokens: int) -> str:
    """A prompt of exactly ``tokens`` tokens as the simulator counts them (words separated by spaces)."""
    return " ".join(itertools.islice(itertools.cycle(PROMPT_WORDS), max(0, tokens)))


def trace_request(row: TraceRow, model: str) -> dict[str, Any]:
    """The provider request for one trace row: a prompt of its context tokens, ``max_tokens`` its generated
    tokens (the simulator generates them all, so the job lasts what the trace's request did)."""
    return {"model": model, "input": {"prompt": trace_prompt(row.context_tokens), "max_tokens": row.generated_tokens}}


def operation_id(run_id: str, trace: str, row: TraceRow) -> str:
    """The operation id of ``row`` of ``trace`` in the run ``run_id``: ``<run_id>-<trace>-<row, 6 digits>``."""
    return f"{run_id}-{trace}-{row.row:06d}"


async def replay_trace(
    producer: SubmissionProducer,
    rows: Iterable[TraceRow],
    *,
    trace: str,
    run_id: str,
    compression: float,
    model: str,
    on_sent: Callable[[int], None] | None = None,
) -> list[str]:
    """Publish ``rows`` at their trace arrival times divided by ``compression``; returns the operation ids.

    Operation ids are ``<run_id>-<trace>-<row>`` so a run can be replayed without colliding with another.
    """
    started = time.monotonic()
    ids: list[str] = []
    pending: list[asyncio.Future[Any]] = []
    for row in rows:
        due = started + row.arrival_s / compression
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        op = operation_id(run_id, trace, row)
        source = {"trace": trace, "row": row.row, "arrival_s": row.arrival_s}
        pending.append(await producer.submit(op, trace_request(row, model), source))
        ids.append(op)
        if on_sent is not None:
            on_sent(len(ids))
    await asyncio.gather(*pending)
    return ids
