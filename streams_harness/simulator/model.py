"""Job model of the provider simulator (pure functions, no I/O): what it reads from a request, and how long the
job then takes.

From a ``POST /v1/generations`` body (``request.schema.json``) it reads what a provider would
(:func:`read_request`): ``model``; ``input.prompt``, whose length in tokens (:func:`prompt_tokens`) is the
job's ``context_tokens``; ``input.max_tokens``, which the simulated model always generates in full
(``generated_tokens``); and ``metadata.client_reference``, the client's name for the job.

A simulated generation job goes through three phases, all measured from the
moment the ``POST /v1/generations`` request created it::

    created_at ──queue──▶ started_at ──prefill + decode──▶ completed_at

with the durations (milliseconds of wall-clock time)::

    queue_ms   = queue_ms_base                                  / compression
    prefill_ms = context_tokens   * prefill_ms_per_token         / compression
    decode_ms  = generated_tokens * decode_ms_per_token          / compression

Defaults: ``queue_ms_base = 200`` ms, ``prefill_ms_per_token = 0.02`` ms
(50 000 context tokens/s), ``decode_ms_per_token = 25`` ms (40 generated
tokens/s) and ``compression = 1.0``.  ``compression`` speeds the whole clock
up: with ``compression = 60`` a job with 10 000 context tokens and 400
generated tokens takes ``(200 + 200 + 10 000) / 60 ≈ 173`` ms instead of
10.4 s.

The job is ``queued`` while ``now < started_at``, ``running`` while
``started_at <= now < completed_at`` and terminal (``succeeded`` or
``failed``) from ``completed_at`` on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

JobStatus = Literal["queued", "running", "succeeded", "failed", "canceled"]
TerminalStatus = Literal["succeeded", "failed"]

DEFAULT_QUEUE_MS = 200.0
DEFAULT_PREFILL_MS_PER_TOKEN = 0.02
DEFAULT_DECODE_MS_PER_TOKEN = 25.0


#: One token of a prompt: a run of letters, digits and underscores, or any other single non-space character.
_TOKEN = re.compile(r"\w+|[^\w\s]")


def prompt_tokens(prompt: str) -> int:
    """The prompt's length in tokens as the simulated provider counts them (:data:`_TOKEN`).

    ``"Write a haiku about leases"`` is 5 tokens, ``"leases."`` 2. A real tokenizer splits words further; this
    count only has to be stable and to match the trace replay, whose prompts are words separated by spaces
    (``n`` words are ``n`` tokens).
    """
    return sum(1 for _ in _TOKEN.finditer(prompt))


@dataclass(frozen=True, slots=True)
class JobRequest:
    """What the simulator reads from one valid request body.

    Attributes:
        model: ``model``.
        context_tokens: tokens of ``input.prompt`` (:func:`prompt_tokens`).
        generated_tokens: ``input.max_tokens``: the simulated model always generates them all.
        client_reference: ``metadata.client_reference``, or None when absent.
    """

    model: str
    context_tokens: int
    generated_tokens: int
    client_reference: str | None


def read_request(body: Mapping[str, Any]) -> JobRequest:
    """The :class:`JobRequest` of a body that satisfies ``request.schema.json`` (checked by the caller)."""
    metadata = body.get("metadata") or {}
    return JobRequest(
        model=body["model"],
        context_tokens=prompt_tokens(body["input"]["prompt"]),
        generated_tokens=int(body["input"]["max_tokens"]),
        client_reference=metadata.get("client_reference"),
    )


@dataclass(frozen=True, slots=True)
class JobDurations:
    """Phase durations of one job, in milliseconds of (compressed) wall-clock time.

    Attributes:
        queue_ms: time from creation until the job starts running.
        prefill_ms: time spent on the prompt (``context_tokens``).
        decode_ms: time spent generating (``generated_tokens``).
    """

    queue_ms: float
    prefill_ms: float
    decode_ms: float

    @property
    def running_ms(self) -> float:
        """Milliseconds between ``started_at`` and ``completed_at`` (prefill + decode)."""
        return self.prefill_ms + self.decode_ms

    @property
    def total_ms(self) -> float:
        """Milliseconds between ``created_at`` and ``completed_at``."""
        return self.queue_ms + self.prefill_ms + self.decode_ms


def job_durations(
    context_tokens: int,
    generated_tokens: int,
    *,
    queue_ms: float = DEFAULT_QUEUE_MS,
    prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN,
    decode_ms_per_token: float = DEFAULT_DECODE_MS_PER_TOKEN,
    compression: float = 1.0,
) -> JobDurations:
    """Compute the phase durations of a job (see the module docstring for the formula).

    Args:
        context_tokens: prompt size in tokens, ``>= 0``.
        generated_tokens: output size in tokens, ``>= 1``.
        queue_ms: fixed queueing delay in ms before the job starts (uncompressed).
        prefill_ms_per_token: ms per context token (uncompressed).
        decode_ms_per_token: ms per generated token (uncompressed).
        compression: clock speed-up factor ``> 0``; every duration is divided by it.

    Returns:
        The three phase durations in ms of wall-clock time.

    Raises:
        ValueError: on negative tokens or a non-positive compression.
    """
    if context_tokens < 0:
        raise ValueError("context_tokens must be >= 0")
    if generated_tokens < 1:
        raise ValueError("generated_tokens must be >= 1")
    if compression <= 0:
        raise ValueError("compression must be > 0")
    return JobDurations(
        queue_ms=queue_ms / compression,
        prefill_ms=context_tokens * prefill_ms_per_token / compression,
        decode_ms=generated_tokens * decode_ms_per_token / compression,
    )


def job_schedule(created_at: float, durations: JobDurations) -> tuple[float, float]:
    """Return ``(started_at, completed_at)`` in unix seconds for a job created at ``created_at``.

    Args:
        created_at: creation time, unix seconds.
        durations: the job's phase durations (ms).
    """
    started_at = created_at + durations.queue_ms / 1000.0
    completed_at = started_at + durations.running_ms / 1000.0
    return started_at, completed_at


def status_at(now: float, started_at: float, completed_at: float, final_status: TerminalStatus) -> JobStatus:
    """Status of a job at time ``now`` (all times unix seconds).

    ``queued`` before ``started_at``, ``running`` before ``completed_at``, then
    ``final_status``.
    """
    if now < started_at:
        return "queued"
    if now < completed_at:
        return "running"
    return final_status


def poll_after_ms(now: float, completed_at: float, *, min_ms: int = 50, max_ms: int = 5000) -> int:
    """Polling hint: the ms remaining until ``completed_at`` (rounded up), clamped to ``[min_ms, max_ms]``.

    The schedule is already compressed, so the hint is in real wall-clock ms.  A
    terminal job gets ``min_ms``.
    """
    remaining = (completed_at - now) * 1000.0
    return min(max(math.ceil(remaining), min_ms), max_ms)
