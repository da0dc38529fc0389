"""Fakes for the fast unit tier: an in-memory ledger, leases on an in-process Redis, a provider behind
``httpx.MockTransport``, and a :class:`~streams.worker.runtime.Runtime` built from them.

:class:`InMemoryLedger` implements the methods of :class:`streams.ledger.store.Ledger` that the dispatcher, the observer
(with its stall rules), the poll scheduler, the reconciler and the outbox relay call, with the same rules as the
SQL in ``streams/queries`` and the triggers of the migrations:

* every state change must be legal (:func:`streams.model.states.can_transition`; the ``operations_guard`` trigger);
* a fenced save names the fencing value of its claim and touches nothing when a newer claim took another one;
* the fencing value never goes back; a saved job id never changes and belongs to one operation;
* every state change writes one transition (``seq`` numbered) and its outbox event, as
  ``operations_log_transition`` does; a ``succeeded`` observation writes one outbox row per output.

Time is the ledger's own clock: real monotonic time plus :meth:`InMemoryLedger.advance`, so a unit test can
skip a stale-after window or a grace window without waiting, and an integration test can run the fake on real
time side by side with the real ledger (``tests/integration/test_fake_ledger_contract.py`` compares them).
Not modelled: the accounting tables (``remote_jobs``, refunds, summaries) beyond the list of remote calls, and
operators' decisions.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import fakeredis
import httpx

from streams.config import Settings
from streams.coordination.lease import LeaseManager
from streams.errors import LedgerDataError, LedgerUnavailableError
from streams.ledger.protocol import PipelineLedger
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
    sources_for,
)
from streams.ledger.waiting import WaitsOutOutages, waits_out_outages
from streams.ledger.written import AnnouncesTransitions, writes_transitions
from streams.model.answers import JobSnapshot, LookupJob, clean_text, failed_reason
from streams.model.codes import POLL_SETBACKS, ReasonCode, RemoteCallOutcome
from streams.model.states import POLLABLE, OperationState, can_transition, is_terminal
from streams.remote.client import RemoteClient
from streams.wire import exactjson
from streams.worker.runtime import Runtime

S = OperationState
_REASON_CODES = frozenset(c.value for c in ReasonCode)
_OUTCOMES = frozenset(c.value for c in RemoteCallOutcome)


@dataclass
class Operation:
    """One row of ``operations`` (the columns the pipeline reads or its rules depend on; times in seconds of
    the ledger's clock)."""

    operation_id: str
    request: str
    submitted_at_ms: int
    source: str | None
    accepted_at: float
    updated_by: str
    state: OperationState = S.ACCEPTED
    fencing_token: int = 0
    transition_seq: int = 1
    remote_job_id: str | None = None
    #: The id of the dispatcher claim that moved it to submitting.
    claim_id: uuid.UUID | None = None
    poll_claim_id: int = 0
    #: The id of the latest observer claim of a poll.
    observe_claim_id: uuid.UUID | None = None
    #: The scheduler's latest claim is not yet taken by an observer (nor rescheduled): ``poll_claimed_at`` set.
    poll_claimed: bool = False
    #: A callback came while the poll was claimed or being observed, or made it due (``hinted_at`` set).
    hinted: bool = False
    next_poll_at: float | None = None
    poll_count: int = 0
    reason: str | None = None
    reason_code: ReasonCode | None = None
    last_observation: dict[str, Any] | None = None
    remote_completed_at_ms: int | None = None
    updated_at: float = 0.0
    state_entered_at: float = 0.0
    remote_job_id_saved_at: float | None = None
    observing_since: float | None = None
    unknown_status_count: int = 0
    failed_poll_count: int = 0
    next_lookup_at: float | None = None
    lookup_count: int = 0
    lookup_gave_up_at: float | None = None
    cancel_attempts: int = 0
    cancel_outcome: RemoteCallOutcome | None = None
    cancel_answered: bool = False


@dataclass(frozen=True)
class Cancellation:
    """One row of ``cancellations`` (migration 0012)."""

    operation_id: str
    path: CancelPath
    actor: str
    reason: str
    state_when_asked: OperationState | None


@dataclass(frozen=True)
class Transition:
    """One row of the transition log."""

    operation_id: str
    seq: int
    from_state: OperationState | None
    to_state: OperationState
    fencing_token: int
    reason: str | None


@dataclass
class OutboxRow:
    """One outbox row; ``payload`` is the event's JSON value."""

    id: int
    event_id: str
    topic_role: str
    operation_id: str
    output_id: str | None
    payload: dict[str, Any]
    published: bool = False


@dataclass
class InMemoryLedger(WaitsOutOutages, AnnouncesTransitions):
    """The ledger in memory (see module docstring). ``worker`` is written as ``updated_by``.

    Set ``unavailable_calls`` to make the next N calls raise :class:`LedgerUnavailableError` (PostgreSQL down);
    the statements the real ledger waits out (:func:`streams.ledger.waiting.waits_out_outages`) are waited out
    here too, with the policy the runtime gives. Implements :class:`streams.ledger.protocol.PipelineLedger`.
    """

    worker: str = "fake-worker"
    operations: dict[str, Operation] = field(default_factory=dict)
    transitions: list[Transition] = field(default_factory=list)
    outbox: list[OutboxRow] = field(default_factory=list)
    #: ``announce_transitions`` calls so far.
    announcements: int = 0
    #: The ``probe`` argument of every ``relay_outbox`` call, in order.
    relay_probes: list[bool] = field(default_factory=list)
    remote_calls: list[RemoteCall] = field(default_factory=list)
    cancellations: dict[str, Cancellation] = field(default_factory=dict)
    #: Operations whose erased request met a replay of their id (note_erased_replay), in order.
    replayed: list[str] = field(default_factory=list)
    #: Callback deliveries recorded: webhook id -> operation id.
    callback_deliveries: dict[str, str] = field(default_factory=dict)
    #: Call ids of the accounting rows written (a repeat of one writes nothing).
    call_ids: set[uuid.UUID] = field(default_factory=set)
    unavailable_calls: int = 0
    _offset_s: float = 0.0
    _t: float = 0.0
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    # --- the clock and the rules -----------------------------------------------------------------------------

    def now(self) -> float:
        """The ledger's clock (s): monotonic time plus what :meth:`advance` added."""
        return time.monotonic() + self._offset_s

    def advance(self, seconds: float) -> None:
        """Move the ledger's clock forward (a window passes without waiting for it)."""
        self._offset_s += seconds

    def _call(self, what: str) -> None:
        """Start one statement: its time is fixed (PostgreSQL's ``now()`` is the transaction's time)."""
        self._t = self.now()
        if self.unavailable_calls > 0:
            self.unavailable_calls -= 1
            raise LedgerUnavailableError(f"PostgreSQL unavailable during {what}: fake outage")

    def _write(self, op: Operation, also: Callable[[Operation], None] | None = None, **changes: Any) -> None:
        """One UPDATE of ``op`` through the rules of ``operations_guard`` and ``operations_log_transition``.

        ``also`` writes the rest of the statement: it runs after the checks and before the transition is logged
        (the logging trigger fires at the end of the statement, after the statement's own outbox rows).
        """
        new = replace(op, **changes)
        if new.state != op.state and not can_transition(op.state, new.state):
            raise LedgerDataError(f"illegal transition {op.state} -> {new.state} for operation {op.operation_id}")
        if new.fencing_token < op.fencing_token:
            raise LedgerDataError(f"fencing token of operation {op.operation_id} would go back")
        if op.remote_job_id is not None and new.remote_job_id != op.remote_job_id:
            raise LedgerDataError(f"remote job id of operation {op.operation_id} is saved and never changes")
        if op.remote_job_id is None and new.remote_job_id is not None:
            if any(o.remote_job_id == new.remote_job_id for o in self.operations.values()):
                raise LedgerDataError(f"remote job id {new.remote_job_id} is already saved for another operation")
            new.remote_job_id_saved_at = new.observing_since = self._t
        if new.next_poll_at is not None and new.state not in POLLABLE:
            raise LedgerDataError(f"operation {op.operation_id}: a poll is scheduled only while pollable")
        if new.state in (S.UNCERTAIN, S.REJECTED) and new.reason is None:
            raise LedgerDataError(f"operation {op.operation_id}: {new.state} needs a reason")
        if (new.reason is None) != (new.reason_code is None):
            raise LedgerDataError(f"operation {op.operation_id}: a reason and its code are both set or both empty")
        if new.reason_code is not None and new.reason_code not in _REASON_CODES:  # the reference table's rule
            raise LedgerDataError(f"operation {op.operation_id}: unknown reason code {new.reason_code!r}")
        new.updated_at = self._t
        changed = new.state != op.state
        if changed:
            new.transition_seq = op.transition_seq + 1
            new.state_entered_at = new.updated_at
        self.operations[op.operation_id] = new
        if also is not None:
            also(new)
        if changed:
            self._log_transition(new, op.state)

    def _log_transition(self, op: Operation, previous: OperationState | None) -> None:
        event_id = f"transition:{op.operation_id}:{op.transition_seq}:{op.state}"
        self.transitions.append(
            Transition(op.operation_id, op.transition_seq, previous, op.state, op.fencing_token, op.reason)
        )
        payload = {
            "event_id": event_id,
            "operation_id": op.operation_id,
            "seq": op.transition_seq,
            "from_state": None if previous is None else previous.value,
            "to_state": op.state.value,
            "fencing_token": op.fencing_token,
            "remote_job_id": op.remote_job_id,
            "reason": op.reason,
            "at_ms": int(time.time() * 1000),
        }
        self.outbox.append(OutboxRow(next(self._ids), event_id, "transitions", op.operation_id, None, payload))

    def _fenced(self, operation_id: str, fencing_token: int, states: frozenset[OperationState]) -> Operation | None:
        op = self.operations.get(operation_id)
        if op is None or op.fencing_token != fencing_token or op.state not in states:
            return None
        return op

    def state(self, operation_id: str) -> OperationState:
        """The operation's state (test helper)."""
        return self.operations[operation_id].state

    # --- the ledger's interface ------------------------------------------------------------------------------

    async def announce_transitions(self) -> None:
        """Counted in ``announcements``."""
        self.announcements += 1

    async def close(self) -> None:
        """Nothing to close."""

    @writes_transitions
    @waits_out_outages("accept")
    async def accept(
        self, operation_id: str, request_text: str, *, submitted_at_ms: int, source_text: str | None = None
    ) -> bool:
        self._call(f"accept {operation_id}")
        if operation_id in self.operations:
            return False
        now = self._t
        op = Operation(
            operation_id,
            request_text,
            submitted_at_ms,
            source_text,
            accepted_at=now,
            updated_by=self.worker,
            updated_at=now,
            state_entered_at=now,
        )
        self.operations[operation_id] = op
        self._log_transition(op, None)
        return True

    @waits_out_outages("read")
    async def get_operation(self, operation_id: str) -> dict[str, Any] | None:
        self._call(f"read {operation_id}")
        op = self.operations.get(operation_id)
        if op is None:
            return None
        return {
            "operation_id": op.operation_id,
            "state": op.state.value,
            "remote_job_id": op.remote_job_id,
            "fencing_token": op.fencing_token,
            "poll_claim_id": op.poll_claim_id,
            "next_poll_at": op.next_poll_at,
            "poll_count": op.poll_count,
            "reason": op.reason,
            "last_observation": op.last_observation,
            "request": op.request,
        }

    @waits_out_outages("note replay")
    async def note_erased_replay(self, operation_id: str) -> bool:
        self._call(f"note a replay of erased {operation_id}")
        op = self.operations.get(operation_id)
        if op is None or op.request != "null":
            return False
        self.replayed.append(operation_id)
        return True

    @writes_transitions
    @waits_out_outages("claim submit")
    async def claim_for_submit(self, operation_id: str, claim_id: uuid.UUID | None = None) -> int | None:
        self._call(f"claim {operation_id}")
        op = self.operations.get(operation_id)
        if op is not None and op.state is S.SUBMITTING and claim_id is not None and op.claim_id == claim_id:
            return op.fencing_token  # the same claim again: its reply was lost
        if op is None or op.state is not S.ACCEPTED:
            return None
        claim_id = claim_id or uuid.uuid4()
        asked = self.cancellations.get(operation_id)
        if asked is not None:  # a cancellation recorded before the claim: canceled, no POST
            self._write(
                op,
                state=S.CANCELED,
                fencing_token=op.fencing_token + 1,
                claim_id=claim_id,
                reason=f"canceled before submit (asked by {asked.path}): {asked.reason}",
                reason_code=ReasonCode.CANCELED_BEFORE_SUBMIT,
                updated_by=self.worker,
            )
            return None
        self._write(
            op, state=S.SUBMITTING, fencing_token=op.fencing_token + 1, claim_id=claim_id, updated_by=self.worker
        )
        return op.fencing_token + 1

    @writes_transitions
    @waits_out_outages("save job id")
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
    ) -> bool | FirstPollClaim:
        self._call(f"save job id of {operation_id}")
        saved = self._save_submitted(
            operation_id, fencing_token, remote_job_id, first_poll_delay_s, reason, first_poll_claim_id
        )
        self._record_call(call)  # written or refused, as the real statement does
        return saved

    def _save_submitted(
        self,
        operation_id: str,
        fencing_token: int,
        remote_job_id: str,
        first_poll_delay_s: float,
        reason: str | None,
        claim_id: uuid.UUID | None,
    ) -> bool | FirstPollClaim:
        saved = self.operations.get(operation_id)
        if saved is not None and saved.remote_job_id == remote_job_id and saved.fencing_token >= fencing_token:
            # the same save again: its reply was lost (the fencing value may have risen since); its first poll's
            # claim when nothing claimed since
            if (
                claim_id is not None
                and saved.observe_claim_id == claim_id
                and saved.fencing_token == fencing_token + 1
                and not saved.poll_claimed
                and saved.state in POLLABLE
            ):
                return self._first_poll_claim(saved)
            return True
        op = self._fenced(operation_id, fencing_token, frozenset({S.SUBMITTING, S.UNCERTAIN}))
        if op is None or op.remote_job_id is not None:
            return False
        cancel_recorded = operation_id in self.cancellations
        claims = claim_id is not None and not cancel_recorded
        # the first poll's claim, as claim_for_observe writes it, in the same write (one transition)
        claim: dict[str, Any] = (
            {
                "fencing_token": op.fencing_token + 1,
                "poll_claim_id": op.poll_claim_id + 1,
                "poll_claimed": False,
                "observe_claim_id": claim_id,
                "hinted": False,
            }
            if claims
            else {}
        )
        self._write(
            op,
            state=S.SUBMITTED,
            remote_job_id=remote_job_id,
            reason=reason,
            reason_code=None if reason is None else ReasonCode.JOB_ID_VIA_ERROR,
            next_poll_at=self._t if cancel_recorded else self._t + first_poll_delay_s,
            next_lookup_at=None,
            updated_by=self.worker,
            **claim,
        )
        return self._first_poll_claim(self.operations[operation_id]) if claims else True

    def _first_poll_claim(self, op: Operation) -> FirstPollClaim:
        since = op.observing_since if op.observing_since is not None else op.accepted_at
        claim = self._observe_claim(op, self._t - since)
        # claimed with no cancellation recorded (a repeat's answer says so too, as the statement's does)
        return FirstPollClaim(op.poll_claim_id, replace(claim, cancel_asked=False))

    @waits_out_outages("record late job")
    async def record_late_job(self, operation_id: str, remote_job_id: str) -> str | None:
        """The decided operation's state (accounting not modelled), or None as the real ledger answers."""
        self._call(f"record late job {remote_job_id} for {operation_id}")
        op = self.operations.get(operation_id)
        if op is None or op.state in (S.ACCEPTED, S.SUBMITTING, S.UNCERTAIN) or op.remote_job_id == remote_job_id:
            return None
        return op.state.value

    @writes_transitions
    @waits_out_outages("save without job")
    async def save_submission_without_job(
        self, operation_id: str, fencing_token: int, state: OperationState, reason: str, reason_code: ReasonCode
    ) -> bool:
        if state not in (S.REJECTED, S.UNCERTAIN):
            raise ValueError(f"a submission without a job ends rejected or uncertain, not {state}")
        self._call(f"save {state} for {operation_id}")
        ended = self.operations.get(operation_id)
        if (
            ended is not None
            and (ended.state, ended.reason, ended.reason_code) == (state, clean_text(reason), reason_code)
            and ended.fencing_token == fencing_token
        ):
            return True  # the same end again: its reply was lost
        op = self._fenced(operation_id, fencing_token, frozenset({S.SUBMITTING}))
        if op is None:
            return False
        self._write(op, state=state, reason=clean_text(reason), reason_code=reason_code, updated_by=self.worker)
        return True

    @writes_transitions
    async def reconcile_stale_submitting(self, stale_after_s: float, batch_size: int) -> list[str]:
        self._call("reconcile submitting")
        now = self._t
        stale = sorted(
            (o for o in self.operations.values() if o.state is S.SUBMITTING and o.updated_at < now - stale_after_s),
            key=lambda o: o.updated_at,
        )[:batch_size]
        reason = (
            f"no outcome saved within {stale_after_s:g} s of submitting (dispatcher died or lost contact "
            "mid-flight); the POST may have created a job: reconcile, never resubmit automatically"
        )
        for op in stale:
            self._write(
                op, state=S.UNCERTAIN, reason=reason, reason_code=ReasonCode.NO_OUTCOME_SAVED, updated_by=self.worker
            )
        return [op.operation_id for op in stale]

    async def stale_accepted(self, stale_after_s: float, batch_size: int) -> list[tuple[str, str]]:
        self._call("find stale accepted")
        stale = sorted(
            (o for o in self.operations.values() if o.state is S.ACCEPTED and o.updated_at < self._t - stale_after_s),
            key=lambda o: o.updated_at,
        )[:batch_size]
        return [(o.operation_id, o.request) for o in stale]

    async def next_due_in_s(self, submitting_stale_after_s: float, accepted_stale_after_s: float) -> SchedulerDue:
        self._call("read next scheduler work due")
        due = [o.next_poll_at for o in self.operations.values() if o.state in POLLABLE and o.next_poll_at is not None]
        stale = [
            o.updated_at + (submitting_stale_after_s if o.state is S.SUBMITTING else accepted_stale_after_s)
            for o in self.operations.values()
            if o.state in (S.SUBMITTING, S.ACCEPTED)
        ]
        return SchedulerDue(min(due) - self._t if due else None, min(stale) - self._t if stale else None)

    async def claim_due_polls_and_next(
        self, batch_size: int, visibility_timeout_s: float, bound: ClaimBound | None = None
    ) -> tuple[list[DuePoll], float | None]:
        polls = await self.claim_due_polls(batch_size, visibility_timeout_s, bound)
        due = [o.next_poll_at for o in self.operations.values() if o.state in POLLABLE and o.next_poll_at is not None]
        return polls, (min(due) - self._t if due else None)

    async def claim_due_polls(
        self, batch_size: int, visibility_timeout_s: float, bound: ClaimBound | None = None
    ) -> list[DuePoll]:
        """Unbounded: the bound on polls claimed and not yet taken is the SQL's, tested on PostgreSQL."""
        self._call("claim due polls")
        now = self._t
        due = sorted(
            (
                o
                for o in self.operations.values()
                if o.state in POLLABLE and o.next_poll_at is not None and o.next_poll_at <= now
            ),
            key=lambda o: o.next_poll_at or 0.0,
        )[:batch_size]
        polls = []
        for op in due:
            assert op.remote_job_id is not None
            self._write(
                op, next_poll_at=now + visibility_timeout_s, poll_claim_id=op.poll_claim_id + 1, poll_claimed=True
            )
            polls.append(DuePoll(op.operation_id, op.remote_job_id, op.poll_claim_id + 1, int(now * 1000)))
        return polls

    @waits_out_outages("claim observe")
    async def claim_for_observe(
        self, operation_id: str, poll_claim_id: int, claim_id: uuid.UUID | None = None
    ) -> ObserveClaim | None:
        self._call(f"claim observe {operation_id}")
        op = self.operations.get(operation_id)
        if op is None or op.poll_claim_id != poll_claim_id or op.state not in POLLABLE:
            return None
        assert op.remote_job_id is not None
        since = op.observing_since if op.observing_since is not None else op.accepted_at
        if not op.poll_claimed:
            if claim_id is not None and op.observe_claim_id == claim_id:  # the same claim again: its reply was lost
                return self._observe_claim(op, self._t - since)
            return None
        self._write(
            op,
            fencing_token=op.fencing_token + 1,
            updated_by=self.worker,
            poll_claimed=False,
            observe_claim_id=claim_id or uuid.uuid4(),
            hinted=False,
        )
        return self._observe_claim(self.operations[operation_id], self._t - since)

    def _observe_claim(self, op: Operation, observed_for_s: float) -> ObserveClaim:
        assert op.remote_job_id is not None
        return ObserveClaim(
            op.fencing_token,
            op.remote_job_id,
            op.state,
            op.poll_count,
            observed_for_s,
            op.operation_id in self.cancellations,
            op.cancel_answered,
            op.cancel_attempts,
        )

    @waits_out_outages("reschedule")
    async def reschedule_poll(self, operation_id: str, poll_claim_id: int, delay_s: float) -> bool:
        self._call(f"reschedule {operation_id}")
        op = self.operations.get(operation_id)
        if op is None or op.poll_claim_id != poll_claim_id or op.state not in POLLABLE:
            return False
        self._write(op, next_poll_at=self._t + delay_s, poll_claimed=False)
        return True

    @writes_transitions
    @waits_out_outages("save observation")
    async def save_observation(
        self,
        operation_id: str,
        fencing_token: int,
        snapshot: JobSnapshot,
        next_poll_delay_s: float | None,
        call: RemoteCall | None = None,
    ) -> SaveOutcome:
        self._call(f"save observation of {operation_id}")
        outcome = self._save_observation(operation_id, fencing_token, snapshot, next_poll_delay_s)
        self._record_call(call)  # saved or refused, as the real statement does; not when it raised
        return outcome

    def _record_call(self, call: RemoteCall | None) -> None:
        """The accounting row a save carries, once per call id."""
        if call is None or call.call_id in self.call_ids:
            return
        self.call_ids.add(call.call_id)
        self.remote_calls.append(call)

    def _save_observation(
        self, operation_id: str, fencing_token: int, snapshot: JobSnapshot, next_poll_delay_s: float | None
    ) -> SaveOutcome:
        new = snapshot.state
        terminal = is_terminal(new)
        reason = None
        if new is S.FAILED and snapshot.error:
            reason = failed_reason(snapshot.error, snapshot.own_message)
        outputs: list[dict[str, Any]] = [
            {"output_id": str(o["id"]), "position": i, "payload": o} for i, o in enumerate(snapshot.outputs)
        ]
        if "\\u0000" in exactjson.dumps([snapshot.as_observation(), outputs]).decode():
            raise LedgerDataError(f"PostgreSQL refused the values of save observation of {operation_id}: NUL in jsonb")
        op = self.operations.get(operation_id)
        allowed = frozenset(OperationState(s) for s in sources_for(new))
        if op is None or op.fencing_token != fencing_token or op.state not in allowed:
            if op is not None and op.fencing_token != fencing_token:
                return SaveOutcome.REFUSED_FENCING
            return SaveOutcome.REFUSED_ORDER

        def write_outputs(saved: Operation) -> None:
            if new is not S.SUCCEEDED:
                return
            taken = {r.output_id for r in self.outbox if r.operation_id == operation_id}
            for out in outputs:
                if out["output_id"] in taken:
                    continue
                event_id = f"output:{operation_id}:{out['output_id']}"
                payload = {
                    "event_id": event_id,
                    "operation_id": operation_id,
                    "output_id": out["output_id"],
                    "position": out["position"],
                    "remote_job_id": saved.remote_job_id,
                    "output": out["payload"],
                    "remote_completed_at_ms": snapshot.completed_at_ms,
                    "recorded_at_ms": int(time.time() * 1000),
                }
                if snapshot.expires_at_ms(out["position"]) is not None:
                    payload["expires_at_ms"] = snapshot.expires_at_ms(out["position"])
                row = OutboxRow(next(self._ids), event_id, "outputs_delivered", operation_id, out["output_id"], payload)
                self.outbox.append(row)

        cancel_pending = op.cancel_attempts == 0 and not op.cancel_answered and operation_id in self.cancellations
        hint_pending = op.hinted and not op.poll_claimed  # a poll claimed since serves the hint
        due_now = not (terminal or next_poll_delay_s is None) and (cancel_pending or hint_pending)
        self._write(
            op,
            also=write_outputs,
            state=new,
            last_observation=snapshot.as_observation(),
            poll_count=op.poll_count + 1,
            unknown_status_count=0,
            failed_poll_count=0,
            hinted=False,
            next_poll_at=None
            if terminal or next_poll_delay_s is None
            else self._t
            if due_now
            else self._t + next_poll_delay_s,
            remote_completed_at_ms=snapshot.completed_at_ms if terminal else op.remote_completed_at_ms,
            reason=reason,
            reason_code=None if reason is None else ReasonCode.REMOTE_JOB_FAILED,
            updated_by=self.worker,
        )
        return SaveOutcome.SAVED_DUE_NOW if due_now else SaveOutcome.SAVED

    @writes_transitions
    @waits_out_outages("save stalled")
    async def save_stalled(
        self, operation_id: str, fencing_token: int, reason: str, last_answer: dict[str, Any]
    ) -> bool:
        self._call(f"save stalled for {operation_id}")
        op = self._fenced(operation_id, fencing_token, POLLABLE)
        if op is None:
            return False
        self._write(
            op,
            state=S.STALLED,
            reason=clean_text(reason),
            reason_code=ReasonCode.MAX_AGE,
            last_observation=last_answer,
            next_poll_at=None,
            updated_by=self.worker,
        )
        return True

    @writes_transitions
    @waits_out_outages("note not found")
    async def note_not_found(
        self,
        operation_id: str,
        fencing_token: int,
        grace_s: float,
        next_poll_delay_s: float,
        reason: str,
        answer: dict[str, Any],
    ) -> OperationState | None:
        self._call(f"note 404 for {operation_id}")
        op = self._fenced(operation_id, fencing_token, POLLABLE)
        if op is None:
            return None
        now = self._t
        past_grace = op.remote_job_id_saved_at is not None and op.remote_job_id_saved_at < now - grace_s
        if past_grace:
            changes: dict[str, Any] = {
                "state": S.STALLED,
                "reason": clean_text(reason),
                "reason_code": ReasonCode.JOB_NOT_FOUND,
                "last_observation": answer,
                "next_poll_at": None,
            }
        else:
            changes = {"next_poll_at": now + next_poll_delay_s}
        self._write(op, poll_count=op.poll_count + 1, updated_by=self.worker, **changes)
        return self.operations[operation_id].state

    @writes_transitions
    @waits_out_outages("note poll setback")
    async def note_poll_setback(
        self,
        operation_id: str,
        fencing_token: int,
        setback: ReasonCode,
        limit: int,
        next_poll_delay_s: float,
        reason: str,
        answer: dict[str, Any],
    ) -> tuple[OperationState, int] | None:
        if setback not in POLL_SETBACKS:
            raise ValueError(f"note_poll_setback: {setback} is not a poll setback (one of {sorted(POLL_SETBACKS)})")
        self._call(f"note poll setback ({setback}) for {operation_id}")
        op = self._fenced(operation_id, fencing_token, POLLABLE)
        if op is None:
            return None
        unknown = setback is ReasonCode.UNKNOWN_STATUS
        count = (op.unknown_status_count if unknown else op.failed_poll_count) + 1
        changes: dict[str, Any] = (
            {"state": S.STALLED, "reason": clean_text(reason), "reason_code": setback, "next_poll_at": None}
            if count >= limit
            else {"next_poll_at": self._t + next_poll_delay_s}
        )
        if unknown or count >= limit:  # an unknown status is an observation; a failure's answer is kept at the end
            changes["last_observation"] = answer
        changes["unknown_status_count" if unknown else "failed_poll_count"] = count
        self._write(op, poll_count=op.poll_count + 1, updated_by=self.worker, **changes)
        return self.operations[operation_id].state, count

    async def claim_due_lookups(self, batch_size: int, lag_s: float, visibility_timeout_s: float) -> list[LookupClaim]:
        self._call("claim due lookups")
        now = self._t

        def due_at(o: Operation) -> float:
            return o.next_lookup_at if o.next_lookup_at is not None else o.state_entered_at + lag_s

        due = sorted(
            (
                o
                for o in self.operations.values()
                if o.state is S.UNCERTAIN and o.lookup_gave_up_at is None and due_at(o) <= now
            ),
            key=lambda o: o.next_lookup_at if o.next_lookup_at is not None else o.state_entered_at,
        )[:batch_size]
        claims = []
        for op in due:
            self._write(
                op,
                fencing_token=op.fencing_token + 1,
                next_lookup_at=now + visibility_timeout_s,
                lookup_count=op.lookup_count + 1,
                updated_by=self.worker,
            )
            claims.append(
                LookupClaim(op.operation_id, op.fencing_token + 1, now - op.state_entered_at, op.lookup_count + 1)
            )
        return claims

    @writes_transitions
    @waits_out_outages("adopt found job")
    async def adopt_found_job(
        self, claim: LookupClaim, found: list[LookupJob], reason: str, first_poll_delay_s: float
    ) -> bool:
        if not found:
            raise ValueError("adopt_found_job needs at least one job")
        self._call(f"adopt found job for {claim.operation_id}")
        op = self._fenced(claim.operation_id, claim.fencing_token, frozenset({S.UNCERTAIN}))
        if op is None or op.remote_job_id is not None:
            return False
        self._write(
            op,
            state=S.SUBMITTED,
            remote_job_id=found[0].job_id,
            reason=clean_text(reason),
            reason_code=ReasonCode.ADOPTED_BY_LOOKUP,
            next_poll_at=self._t if claim.operation_id in self.cancellations else self._t + first_poll_delay_s,
            next_lookup_at=None,
            updated_by=self.worker,
        )
        return True

    @waits_out_outages("give up lookup")
    async def give_up_lookup(self, claim: LookupClaim, reason: str) -> bool:
        self._call(f"give up lookup for {claim.operation_id}")
        op = self._fenced(claim.operation_id, claim.fencing_token, frozenset({S.UNCERTAIN}))
        if op is None:
            return False
        self._write(
            op,
            lookup_gave_up_at=self._t,
            next_lookup_at=None,
            reason=f"{clean_text(reason)}; became uncertain: {op.reason}"[:2000],
            reason_code=ReasonCode.NOT_FOUND_BY_LOOKUP,
            updated_by=self.worker,
        )
        return True

    @waits_out_outages("reschedule lookup")
    async def reschedule_lookup(self, claim: LookupClaim, delay_s: float) -> bool:
        self._call(f"reschedule lookup for {claim.operation_id}")
        op = self._fenced(claim.operation_id, claim.fencing_token, frozenset({S.UNCERTAIN}))
        if op is None:
            return False
        self._write(op, next_lookup_at=self._t + delay_s)
        return True

    @waits_out_outages("account")
    async def record_remote_call(self, call: RemoteCall) -> None:
        self._call(f"account {call.method} for {call.operation_id}")
        if call.outcome not in _OUTCOMES:  # the reference table's rule
            raise LedgerDataError(f"unknown remote call outcome {call.outcome!r} for {call.operation_id}")
        if call.call_id in self.call_ids:
            return  # the same row again: its reply was lost
        self.call_ids.add(call.call_id)
        self.remote_calls.append(call)

    @writes_transitions
    @waits_out_outages("request cancel")
    async def request_cancel(self, operation_id: str, path: CancelPath, actor: str, reason: str) -> CancelAsk:
        self._call(f"request cancel {operation_id}")
        if not actor.strip() or not reason.strip():
            raise LedgerDataError(f"request cancel of {operation_id}: actor and reason must not be empty")
        op = self.operations.get(operation_id)
        state = op.state if op is not None else None
        recorded = operation_id not in self.cancellations
        if recorded:
            self.cancellations[operation_id] = Cancellation(operation_id, path, actor, reason, state)
        canceled_now = op is not None and op.state is S.ACCEPTED
        if op is not None and canceled_now:
            self._write(
                op,
                state=S.CANCELED,
                reason=f"canceled before submit (asked by {path}): {reason}",
                reason_code=ReasonCode.CANCELED_BEFORE_SUBMIT,
                updated_by=self.worker,
            )
        made_due = (
            recorded
            and op is not None
            and op.state in POLLABLE
            and not op.poll_claimed
            and op.next_poll_at is not None
            and op.next_poll_at > self._t
        )
        if op is not None and made_due:
            self._write(op, next_poll_at=self._t)
        return CancelAsk(operation_id, state, recorded, canceled_now, made_due)

    @waits_out_outages("note cancel call")
    async def note_cancel_call(
        self, operation_id: str, fencing_token: int, outcome: RemoteCallOutcome, answered: bool
    ) -> int | None:
        self._call(f"note cancel call {operation_id}")
        op = self.operations.get(operation_id)
        if op is None or op.fencing_token != fencing_token or op.cancel_answered:
            return None
        op.cancel_attempts += 1
        op.cancel_outcome = outcome
        op.cancel_answered = answered
        return op.cancel_attempts

    @waits_out_outages("note callback")
    async def note_callback(self, webhook_id: str, remote_job_id: str) -> CallbackNote:
        self._call(f"note callback {remote_job_id}")
        if not webhook_id.strip():
            raise LedgerDataError(f"note callback for job {remote_job_id}: empty webhook id")
        op = next((o for o in self.operations.values() if o.remote_job_id == remote_job_id), None)
        if op is None:
            return CallbackNote(None, False, False)
        if webhook_id in self.callback_deliveries:
            return CallbackNote(op.operation_id, False, False)
        self.callback_deliveries[webhook_id] = op.operation_id
        due = op.state in POLLABLE and not op.poll_claimed and op.next_poll_at is not None and op.next_poll_at > self._t
        hinted = op.state in POLLABLE and (due or op.poll_claimed)
        if hinted:
            self._write(op, next_poll_at=self._t if due else op.next_poll_at, hinted=True)
        return CallbackNote(op.operation_id, True, due, hinted)

    async def relay_outbox(
        self,
        batch_size: int,
        publish: Callable[[list[dict[str, Any]]], Awaitable[Collection[int] | None]],
        skip_operation_ids: Sequence[str] = (),
        *,
        probe: bool = False,
    ) -> int | None:
        self._call("relay outbox")
        self.relay_probes.append(probe)
        skip = set(skip_operation_ids)
        batch = [r for r in self.outbox if not r.published and r.operation_id not in skip][:batch_size]
        if not batch:
            return 0
        published = await publish(
            [
                {
                    "id": r.id,
                    "event_id": r.event_id,
                    "topic_role": r.topic_role,
                    "operation_id": r.operation_id,
                    "payload": exactjson.dumps(r.payload).decode(),
                    "expires_at_ms": r.payload.get("expires_at_ms"),
                }
                for r in batch
            ]
        )
        ids = {r.id for r in batch} if published is None else set(published)
        for r in batch:
            if r.id in ids:
                r.published = True
        return len(ids)


@dataclass
class Sent:
    """The runtime's ``send``: records every Kafka record instead of sending it; ``fail`` makes it raise."""

    records: list[tuple[str, bytes, bytes]] = field(default_factory=list)
    fail: Exception | None = None

    async def __call__(self, topic: str, key: bytes, value: bytes) -> None:
        if self.fail is not None:
            raise self.fail
        self.records.append((topic, key, value))

    def values(self, topic: str) -> list[Any]:
        """The JSON values sent to ``topic``, in order."""
        return [exactjson.loads(v) for t, _, v in self.records if t == topic]


#: A provider answering one request, plain or ``async`` (what ``httpx.MockTransport`` takes).
Handler = Callable[[httpx.Request], httpx.Response] | Callable[[httpx.Request], Coroutine[Any, Any, httpx.Response]]


def fake_leases(settings: Settings, server: fakeredis.FakeServer | None = None) -> LeaseManager:
    """The real :class:`LeaseManager` (its Lua scripts run) on an in-process Redis (``fakeredis``); set
    ``server.connected = False`` to make Redis unreachable."""
    client = fakeredis.FakeAsyncRedis(server=server or fakeredis.FakeServer())
    return LeaseManager.from_settings(client, settings)


def mock_remote(settings: Settings, handler: Handler) -> RemoteClient:
    """The worker's :class:`RemoteClient` (as :meth:`RemoteClient.from_settings` builds it) whose HTTP calls are
    answered by ``handler`` (``httpx.MockTransport``)."""
    return RemoteClient.from_settings(settings, transport=httpx.MockTransport(handler))


def as_pipeline_ledger(ledger: InMemoryLedger) -> PipelineLedger:
    """The in-memory ledger as the runtime takes it: ``mypy --strict`` checks it implements the protocol."""
    return ledger


def fake_runtime(
    settings: Settings, handler: Handler, ledger: Any | None = None, leases: LeaseManager | None = None
) -> Runtime:
    """A :class:`Runtime` over the in-memory ledger (or ``ledger``), fake leases and the mock provider; its
    ``send`` is a :class:`Sent`."""
    return Runtime(
        settings,
        ledger if ledger is not None else InMemoryLedger(),
        leases if leases is not None else fake_leases(settings),
        mock_remote(settings, handler),
        Sent(),
        "fake-worker",
    )


async def observed_again(ledger: Any, operation_id: str) -> ObserveClaim:
    """A second observer's claim of ``operation_id`` while the first still holds its own (``ledger``: the real
    :class:`~streams.ledger.store.Ledger` or :class:`InMemoryLedger`): the poll claimed again by the scheduler (as once
    the
    first claim's visibility timeout passed; here by rescheduling it due now), then claimed for observing. A poll
    claim is observed once, so a newer fencing value always comes with a newer poll claim."""
    row = await ledger.get_operation(operation_id)
    assert row is not None
    assert await ledger.reschedule_poll(operation_id, row["poll_claim_id"], 0.0)
    polls = [p for p in await ledger.claim_due_polls(100, 60.0) if p.operation_id == operation_id]
    assert len(polls) == 1
    claim: ObserveClaim | None = await ledger.claim_for_observe(operation_id, polls[0].poll_claim_id)
    assert claim is not None
    return claim
