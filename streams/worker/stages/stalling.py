"""When a known job's answers stop making progress: the observer's way to ``stalled`` (polling stops there until
an operator repolls or fails the operation; :mod:`streams.model.states`).

Three signs, each bounded by a setting, so the GETs spent on a stuck job are bounded too:

* 404 longer than ``not_found_grace_s`` after the job id was saved. Inside the window a 404 only reschedules
  the poll (providers commonly answer 404 for a few seconds after creating a job).
* a status the client does not know (``aborted``, ``paused``, ``null``, ...) ``unknown_status_limit`` GETs
  in a row (a known status resets the count).
* ``failed_poll_limit`` failed GETs in a row (5xx, 3xx, an unreadable or oversized body, a 200 for another job,
  not sent, timeouts and lost connections), each of which also counts toward the job's backoff (a usable answer
  resets the count);
* observed longer than ``max_observation_age_s`` without becoming terminal (whatever the answers: a job that
  never finishes, or GETs that keep failing).

Every decision is one fenced statement of the ledger; the reason and the raw last answer are kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from streams import metrics
from streams.errors import RemoteError, RemoteJobNotFoundError, RemoteUnknownStatusError
from streams.ledger.records import ObserveClaim
from streams.model.answers import clean_text, error_codes
from streams.model.codes import ReasonCode
from streams.model.states import OperationState
from streams.worker.runtime import Runtime

log = logging.getLogger(__name__)


class StallGuard:
    """The observer's checks for a job that stopped making progress (see module docstring).

    Args:
        runtime: the worker's runtime (settings and ledger).
    """

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def too_old(self, claim: ObserveClaim, claimed_at: float) -> bool:
        """True when the job has been observed longer than ``max_observation_age_s``.

        ``claimed_at`` is ``time.monotonic()`` when the claim was taken (its ``observed_for_s`` is as of then).
        """
        observed_for_s = claim.observed_for_s + (time.monotonic() - claimed_at)
        return observed_for_s > self.rt.settings.max_observation_age_s

    async def stall_too_old(self, operation_id: str, claim: ObserveClaim, last_answer: dict[str, Any]) -> bool:
        """Fenced: ``stalled`` because the job is older than the maximum observation age. False when refused."""
        rt = self.rt
        reason = (
            f"observed for more than {rt.settings.max_observation_age_s:.0f} s without becoming terminal; remote job "
            f"{claim.remote_job_id}, last answer: {_short(last_answer)}; repoll or fail it"
        )

        async def save() -> OperationState | None:
            saved = await rt.ledger.save_stalled(operation_id, claim.fencing_token, reason, last_answer)
            return OperationState.STALLED if saved else None

        return await self._decide(operation_id, "max_age", reason, save) is not None

    async def not_found(
        self, operation_id: str, claim: ObserveClaim, exc: RemoteJobNotFoundError, next_poll_delay_s: float
    ) -> OperationState | None:
        """Fenced: a 404 for the saved job id; rescheduled inside the grace window, ``stalled`` past it.

        Returns the state afterwards, None when refused by the fencing value.
        """
        rt = self.rt
        grace_s = rt.settings.not_found_grace_s
        reason = (
            f"not found (404) more than {grace_s:.0f} s after the job id was saved; remote job "
            f"{claim.remote_job_id} may be lost at the provider; repoll or fail it"
        )
        return await self._decide(
            operation_id,
            "not_found",
            reason,
            lambda: rt.ledger.note_not_found(
                operation_id, claim.fencing_token, grace_s, next_poll_delay_s, reason, exc.answer
            ),
        )

    async def unknown_status(
        self, operation_id: str, claim: ObserveClaim, exc: RemoteUnknownStatusError, next_poll_delay_s: float
    ) -> OperationState | None:
        """Fenced: a status the client does not know; ``stalled`` at the ``unknown_status_limit``-th in a row.

        Returns the state afterwards, None when refused by the fencing value.
        """
        rt = self.rt
        limit = rt.settings.unknown_status_limit
        reason = (
            f"a status this client does not know, {limit} times in a row; remote job {claim.remote_job_id}, "
            f"last answer: {_short(exc.answer)}; repoll or fail it"
        )

        return await self._setback(
            operation_id, claim, ReasonCode.UNKNOWN_STATUS, limit, next_poll_delay_s, reason, exc.answer
        )

    async def failed_poll(
        self, operation_id: str, claim: ObserveClaim, exc: RemoteError, next_poll_delay_s: float
    ) -> OperationState | None:
        """Fenced: a GET that failed (counted toward the backoff); ``stalled`` at the ``failed_poll_limit``-th in a
        row, else rescheduled ``next_poll_delay_s`` out.

        Returns the state afterwards, None when refused by the fencing value.
        """
        rt = self.rt
        limit = rt.settings.failed_poll_limit
        last_answer: dict[str, Any] = {"error": clean_text(str(exc), 1000), "http_status": exc.status_code}
        reason = (
            f"{limit} failed polls in a row; remote job {claim.remote_job_id}, last failure: "
            f"{_short(last_answer)}; repoll or fail it"
        )

        return await self._setback(
            operation_id, claim, ReasonCode.POLL_FAILURES, limit, next_poll_delay_s, reason, last_answer
        )

    async def _setback(
        self,
        operation_id: str,
        claim: ObserveClaim,
        setback: ReasonCode,
        limit: int,
        next_poll_delay_s: float,
        reason: str,
        answer: dict[str, Any],
    ) -> OperationState | None:
        """Fenced: one poll setback of the kind ``setback`` noted (``stalled`` at the ``limit``-th in a row, else
        rescheduled ``next_poll_delay_s`` out) and reported under its code. The state afterwards, None when
        refused."""

        async def note() -> OperationState | None:
            noted = await self.rt.ledger.note_poll_setback(
                operation_id, claim.fencing_token, setback, limit, next_poll_delay_s, reason, answer
            )
            return None if noted is None else noted[0]

        return await self._decide(operation_id, setback.value, reason, note)

    async def _decide(
        self,
        operation_id: str,
        kind: str,
        reason: str,
        decide: Callable[[], Awaitable[OperationState | None]],
    ) -> OperationState | None:
        """Run the fenced statement ``decide`` (the ledger waits out PostgreSQL) and report its outcome for the
        sign ``kind`` (``max_age``, ``not_found``, ``unknown_status``, ``poll_failures``): the state afterwards,
        None when refused."""
        state = await decide()
        self._report(operation_id, state, kind, reason)
        return state

    def _report(self, operation_id: str, state: OperationState | None, kind: str, reason: str) -> None:
        if state is None:
            metrics.FENCING_REFUSALS.labels("observe").inc()
            log.warning("%s not noted: a newer claim holds the operation", kind)
        elif state is OperationState.STALLED:
            metrics.STALLED.labels(kind).inc()
            log.warning("stalled: %s", reason)


def _short(answer: dict[str, Any], limit: int = 300) -> str:
    """``answer`` as reason text, without its body and with only the codes of its error
    (:func:`~streams.model.answers.error_codes`): a body or an error's message may carry the user's payload (outputs,
    an echoed prompt), and a reason is published, logged and shown; the ledger keeps the raw answer apart
    (``last_answer``)."""

    def shown(key: str, value: Any) -> str:
        if key == "body" and isinstance(value, str):
            return f"body of {len(value)} chars kept in the ledger"
        if key == "error" and isinstance(value, dict):
            return f"error codes={error_codes(value)!r}"
        return f"{key}={value!r}"

    text = ", ".join(shown(k, v) for k, v in answer.items())
    return text if len(text) <= limit else text[: limit - 3] + "..."
