"""What the remote API's answers become once read, as the ledger records them: one GET of a job
(:class:`JobSnapshot`), one job found by a lookup (:class:`LookupJob`), the job ids this client accepts
(:data:`JOB_ID`), and text made storable (:func:`clean_text`).

Apart from :mod:`streams.remote.client` (which reads the answers over HTTP) so that the ledger, and the operators'
commands with it, need neither the HTTP stack nor the JSON Schemas.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from streams.model.states import OperationState

#: Job ids this client accepts: they go into a URL path and the ledger (at most 256 characters).
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,255}")

#: Operation ids, as the submissions topic's schema takes them (``schemas/generation.submissions.json``, its
#: ``operation_id`` pattern; fullmatch): no other id can be in the ledger.
OPERATION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


#: The longest text member of a failed job's error kept in the operation's reason: a code or a type, not a sentence.
MAX_CODE_CHARS = 64


def error_codes(error: dict[str, Any]) -> dict[str, Any]:
    """The members of a failed job's ``error`` fit for the operation's reason, which goes to logs, the
    ``generation.transitions`` topic and the live view: numbers, booleans, and texts of at most
    :data:`MAX_CODE_CHARS` characters without a blank (``"code": "content_filter"``), under keys of that kind too. A
    sentence (``message``) may quote the prompt or an output; it stays in the ledger's last observation, beside the
    request."""
    kept: dict[str, Any] = {}
    for key, value in error.items():
        if _is_code(key) and (isinstance(value, bool | int | float) or _is_code(value)):
            kept[key] = value
    return kept


def _is_code(text: object) -> bool:
    return isinstance(text, str) and len(text) <= MAX_CODE_CHARS and not any(c.isspace() for c in text)


def failed_reason(error: dict[str, Any], own_message: str | None = None) -> str:
    """The reason of an operation whose job failed with ``error``: its codes (:func:`error_codes`) as JSON, or
    ``no code``, then this client's ``own_message`` when it decided the failure (:attr:`JobSnapshot.own_message`),
    else where the provider's own words are."""
    codes = error_codes(error)
    shown = json.dumps(codes, separators=(",", ":"), ensure_ascii=False) if codes else "no code"
    if own_message is not None:
        return clean_text(f"remote job failed: {shown}: {own_message}")
    return clean_text(f"remote job failed: {shown} (the provider's words: the operation's last observation)")


def clean_text(text: str, limit: int = 2000) -> str:
    """``text`` made storable in PostgreSQL text/jsonb (no NUL) and at most ``limit`` characters."""
    return text.replace("\x00", "\\0")[:limit]


@dataclass(frozen=True)
class LookupJob:
    """One job a lookup by client reference found: its id, the provider's status word and creation time
    (epoch ms, None when the answer did not carry a readable one)."""

    job_id: str
    status: str | None
    created_at_ms: int | None

    def as_record(self) -> dict[str, Any]:
        """JSON-ready ``{"job_id", "status", "created_at_ms"}``."""
        return {"job_id": self.job_id, "status": self.status, "created_at_ms": self.created_at_ms}


@dataclass(frozen=True)
class JobSnapshot:
    """One GET of a remote job.

    ``state`` is the operation state the remote ``status`` maps to; ``outputs`` is a list of dicts with at
    least an ``id``, every number exact (:mod:`streams.wire.exactjson`); ``completed_at_ms`` is the remote completion
    time (epoch ms) when terminal and readable, else None with ``completed_at_problem`` saying why
    (:func:`read_completed_at_ms`). ``charge`` and ``refund`` are the provider's objects as it sent them
    (``{"id", "amount", "currency"}`` in the simulator's dialect), or None; the ledger's accounting records
    them, nothing else interprets them. ``output_expires_at_ms`` holds, per output, when the provider stops
    serving it (epoch ms; the output's ``expires_at``, else the answer's, else completion + ``remote_output_ttl_s``),
    None where unknown.
    """

    job_id: str
    status: str
    state: OperationState
    outputs: list[dict[str, Any]] = field(default_factory=list)
    poll_after_s: float | None = None
    completed_at_ms: int | None = None
    error: dict[str, Any] | None = None
    status_code: int = 200
    duration_ms: float = 0.0
    completed_at_problem: str | None = None
    charge: dict[str, Any] | None = None
    refund: dict[str, Any] | None = None
    output_expires_at_ms: tuple[int | None, ...] = ()
    #: This client's own words for a failure it decided (an answer it cannot carry: a contract violation), shown in the
    #: operation's reason; the provider's words never go here (they may echo the request: :func:`failed_reason`).
    own_message: str | None = None

    def expires_at_ms(self, position: int) -> int | None:
        """When output ``position`` stops being fetchable at the provider (epoch ms), None when unknown."""
        return self.output_expires_at_ms[position] if position < len(self.output_expires_at_ms) else None

    def as_observation(self) -> dict[str, Any]:
        """The JSON saved as the operation's ``last_observation`` (with ``completed_at_problem`` when set)."""
        observation = {
            "job_id": self.job_id,
            "status": self.status,
            "outputs": len(self.outputs),
            "completed_at_ms": self.completed_at_ms,
            "error": self.error,
            "charge": self.charge,
            "refund": self.refund,
        }
        if self.completed_at_problem is not None:
            observation["completed_at_problem"] = self.completed_at_problem
        return observation
