"""The ledger as the worker's pipeline sees it: the statements its stages make, declared once.

:class:`streams.ledger.store.Ledger` (PostgreSQL) implements it, and so does the test suite's in-memory ledger
(``tests/fakes.py``), which ``mypy --strict`` checks against it; ``tests/integration/test_fake_ledger_contract.py``
runs both through the same cases. Each statement's contract is in its docstring on
:class:`~streams.ledger.store.Ledger`.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, Protocol

from streams.ledger.records import (
    CallbackNote,
    CancelAsk,
    CancelPath,
    ClaimBound,
    DuePoll,
    FirstPollClaim,
    LookupClaim,
    ObserveClaim,
    RemoteCall,
    SaveOutcome,
    SchedulerDue,
)
from streams.ledger.waiting import OutageWait
from streams.model.answers import JobSnapshot, LookupJob
from streams.model.codes import ReasonCode, RemoteCallOutcome
from streams.model.states import OperationState


class PipelineLedger(Protocol):
    """The statements of the worker's stages on the ledger (see the module docstring)."""

    #: How its marked statements wait out outages (None: they raise them).
    outage_wait: OutageWait | None

    def wait_out_outages(self, wait: OutageWait | None) -> None: ...

    #: Called after each statement that may have written transitions (streams.ledger.written; None: nobody).
    on_transitions_written: Callable[[], None] | None

    async def accept(
        self, operation_id: str, request_text: str, *, submitted_at_ms: int, source_text: str | None = None
    ) -> bool: ...
    async def get_operation(self, operation_id: str) -> dict[str, Any] | None: ...
    async def note_erased_replay(self, operation_id: str) -> bool: ...
    async def claim_for_submit(self, operation_id: str, claim_id: uuid.UUID | None = None) -> int | None: ...
    async def save_submitted(
        self,
        operation_id: str,
        fencing_token: int,
        remote_job_id: str,
        first_poll_delay_s: float,
        reason: str | None,
        call: RemoteCall | None = None,
        *,
        first_poll_claim_id: uuid.UUID | None = None,
    ) -> bool | FirstPollClaim: ...
    async def save_submission_without_job(
        self, operation_id: str, fencing_token: int, state: OperationState, reason: str, reason_code: ReasonCode
    ) -> bool: ...
    async def record_late_job(self, operation_id: str, remote_job_id: str) -> str | None: ...
    async def reconcile_stale_submitting(self, stale_after_s: float, batch_size: int) -> list[str]: ...
    async def stale_accepted(self, stale_after_s: float, batch_size: int) -> list[tuple[str, str]]: ...
    async def claim_due_polls(
        self, batch_size: int, visibility_timeout_s: float, bound: ClaimBound | None = None
    ) -> list[DuePoll]: ...
    async def claim_due_polls_and_next(
        self, batch_size: int, visibility_timeout_s: float, bound: ClaimBound | None = None
    ) -> tuple[list[DuePoll], float | None]: ...
    async def next_due_in_s(self, submitting_stale_after_s: float, accepted_stale_after_s: float) -> SchedulerDue: ...
    async def claim_for_observe(
        self, operation_id: str, poll_claim_id: int, claim_id: uuid.UUID | None = None
    ) -> ObserveClaim | None: ...
    async def reschedule_poll(self, operation_id: str, poll_claim_id: int, delay_s: float) -> bool: ...
    async def save_observation(
        self,
        operation_id: str,
        fencing_token: int,
        snapshot: JobSnapshot,
        next_poll_delay_s: float | None,
        call: RemoteCall | None = None,
    ) -> SaveOutcome: ...
    async def save_stalled(
        self, operation_id: str, fencing_token: int, reason: str, last_answer: dict[str, Any]
    ) -> bool: ...
    async def note_not_found(
        self,
        operation_id: str,
        fencing_token: int,
        grace_s: float,
        next_poll_delay_s: float,
        reason: str,
        answer: dict[str, Any],
    ) -> OperationState | None: ...
    async def note_poll_setback(
        self,
        operation_id: str,
        fencing_token: int,
        setback: ReasonCode,
        limit: int,
        next_poll_delay_s: float,
        reason: str,
        answer: dict[str, Any],
    ) -> tuple[OperationState, int] | None: ...
    async def claim_due_lookups(
        self, batch_size: int, lag_s: float, visibility_timeout_s: float
    ) -> list[LookupClaim]: ...
    async def adopt_found_job(
        self, claim: LookupClaim, found: list[LookupJob], reason: str, first_poll_delay_s: float
    ) -> bool: ...
    async def give_up_lookup(self, claim: LookupClaim, reason: str) -> bool: ...
    async def reschedule_lookup(self, claim: LookupClaim, delay_s: float) -> bool: ...
    async def record_remote_call(self, call: RemoteCall) -> None: ...
    async def request_cancel(self, operation_id: str, path: CancelPath, actor: str, reason: str) -> CancelAsk: ...
    async def note_cancel_call(
        self, operation_id: str, fencing_token: int, outcome: RemoteCallOutcome, answered: bool
    ) -> int | None: ...
    async def note_callback(self, webhook_id: str, remote_job_id: str) -> CallbackNote: ...
    async def relay_outbox(
        self,
        batch_size: int,
        publish: Callable[[list[dict[str, Any]]], Awaitable[Collection[int] | None]],
        skip_operation_ids: Sequence[str] = (),
        *,
        probe: bool = False,
    ) -> int | None: ...
    async def announce_transitions(self) -> None: ...
    async def close(self) -> None: ...
