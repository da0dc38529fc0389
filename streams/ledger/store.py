"""The pipeline's statements on the ledger: operations, fenced transitions, outputs, outbox and accounting.

Every method is one statement (atomic), except the relay's batch. Writes of observations are *fenced*: they name
the fencing value the worker got when it claimed the operation and touch zero rows if a newer claim happened since
(seed: "Fence durable state changes separately"). The state order is enforced twice: by the ``WHERE`` clause of
each query (``states.can_transition``) and by the ``operations_guard`` trigger; the ``operations_log_transition``
trigger writes the transition log and its outbox event. The hot path's statements are batched
(:mod:`streams.ledger.batching`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import asyncpg

from streams import bounded
from streams.ledger.accounting import Accounting
from streams.ledger.batching import BatchedStatement, Batcher, Request, by_position
from streams.ledger.decisions import Decisions
from streams.ledger.notices import OUTBOX_CHANNEL, TRANSITIONS_PAYLOAD
from streams.ledger.pool import guard
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
from streams.ledger.sql import CALLBACKS, CANCELLATIONS, RECONCILE
from streams.ledger.sql import LEDGER as Q
from streams.ledger.waiting import WaitsOutOutages, waits_out_outages
from streams.ledger.written import AnnouncesTransitions, writes_transitions
from streams.model.answers import JobSnapshot, LookupJob, clean_text, failed_reason
from streams.model.codes import POLL_SETBACKS, ReasonCode, RemoteCallOutcome
from streams.model.states import OperationState, is_terminal
from streams.wire import exactjson


def _json_text(value: Any) -> str:
    return exactjson.dumps(value).decode()


def _inserted(rows: list[asyncpg.Record], batch: list[Request]) -> list[Any]:
    """``accept``: True for each operation inserted now (its row came back), False for a replay."""
    inserted = {row["operation_id"] for row in rows}
    return [request[0] in inserted for request in batch]


def _fencing_token(rows: list[asyncpg.Record], batch: list[Request]) -> list[Any]:
    """``claim_submit``: the fencing value the claim wrote, None where another claim is past it."""
    return [None if row is None else row["fencing_token"] for row in by_position(rows, len(batch))]


def _written(rows: list[asyncpg.Record], batch: list[Request]) -> list[Any]:
    """A fenced write: True where its row came back (written), False where fencing or the state refused it."""
    return [row is not None for row in by_position(rows, len(batch))]


def _submitted(rows: list[asyncpg.Record], batch: list[Request]) -> list[Any]:
    """``save_submitted``: False where refused, the :class:`FirstPollClaim` where the save claimed the first poll,
    True where it saved without."""
    out: list[Any] = []
    for row, request in zip(by_position(rows, len(batch)), batch, strict=True):
        if row is None or not row["first_poll_claimed"]:
            out.append(row is not None)
            continue
        claim = ObserveClaim(
            row["fencing_token"],
            request[2],
            OperationState.SUBMITTED,
            row["poll_count"],
            row["observed_for_s"],
            False,
            row["cancel_answered"],
            row["cancel_attempts"],
        )
        out.append(FirstPollClaim(row["poll_claim_id"], claim))
    return out


def _observe_claim(rows: list[asyncpg.Record], batch: list[Request]) -> list[Any]:
    """``claim_observe``: the claim, None where the poll's claim is stale or the job is not pollable."""
    return [
        None
        if row is None
        else ObserveClaim(
            row["fencing_token"],
            row["remote_job_id"],
            OperationState(row["state"]),
            row["poll_count"],
            row["observed_for_s"],
            row["cancel_asked"],
            row["cancel_answered"],
            row["cancel_attempts"],
        )
        for row in by_position(rows, len(batch))
    ]


def _save_outcome(rows: list[asyncpg.Record], batch: list[Request]) -> list[Any]:
    """``save_observation``: one row per request; saved (with the next poll due now, or not), refused by a newer
    claim, or refused by the state order (or no such operation)."""
    outcomes: list[Any] = []
    for request, row in zip(batch, by_position(rows, len(batch)), strict=True):
        assert row is not None  # one row per request
        if row["saved"]:
            outcomes.append(SaveOutcome.SAVED_DUE_NOW if row["due_now"] else SaveOutcome.SAVED)
        elif row["fencing_token"] is not None and row["fencing_token"] != request[1]:
            outcomes.append(SaveOutcome.REFUSED_FENCING)
        else:
            outcomes.append(SaveOutcome.REFUSED_ORDER)
    return outcomes


def _check_call(
    call: RemoteCall | None, method: str, operation_id: str, fencing_token: int, remote_job_id: str | None = None
) -> None:
    """A call given to a save is the save's own: its ``method``, operation, fencing value (and job, when given).

    Raises:
        ValueError: it is not.
    """
    if call is None:
        return
    if (call.method, call.operation_id, call.fencing_token) != (method, operation_id, fencing_token) or (
        remote_job_id is not None and call.remote_job_id != remote_job_id
    ):
        raise ValueError(
            f"the {call.method} call of {call.operation_id} at fencing value {call.fencing_token} is not the "
            f"{method} of this save ({operation_id} at {fencing_token}); record it with record_remote_call"
        )


def _call_fields(call: RemoteCall | None, *, job: bool) -> tuple[Any, ...]:
    """The accounting columns a save carries for ``call`` (all None without one): call id, status code, outcome,
    with ``job`` the job id, and the duration (ms)."""
    if call is None:
        return (None, None, None, None, None) if job else (None, None, None, None)
    head = (call.call_id, call.status_code, str(call.outcome))
    return (*head, call.remote_job_id, call.duration_ms) if job else (*head, call.duration_ms)


def _nothing(rows: list[asyncpg.Record], batch: list[Request]) -> list[Any]:
    """A write whose callers need no answer (the accounting of remote calls)."""
    return [None] * len(batch)


#: The hot path's batched statements: each request's fields name the query's parallel arrays in order (the
#: operation id first); ``worker`` and ``lock_timeout`` are added by the engine. An operation appears once per
#: statement except in the accounting of remote calls (``distinct=False``: an append, never a conflict).
BATCHED: tuple[BatchedStatement, ...] = (
    BatchedStatement(
        "accept", Q.accept_operation, ("operation_ids", "requests", "submitted_at_ms", "sources"), _inserted
    ),
    BatchedStatement("claim_submit", Q.claim_for_submit, ("operation_ids", "claim_ids"), _fencing_token),
    BatchedStatement(
        "save_submitted",
        Q.save_submitted,
        (
            "operation_ids",
            "fencing_tokens",
            "remote_job_ids",
            "first_poll_delays_s",
            "first_poll_claim_ids",
            "reasons",
            "call_ids",
            "call_status_codes",
            "call_outcomes",
            "call_durations_ms",
        ),
        _submitted,
    ),
    BatchedStatement(
        "claim_observe", Q.claim_for_observe, ("operation_ids", "poll_claim_ids", "claim_ids"), _observe_claim
    ),
    BatchedStatement("reschedule_poll", Q.reschedule_poll, ("operation_ids", "poll_claim_ids", "delays_s"), _written),
    BatchedStatement(
        "save_observation",
        Q.save_observation,
        (
            "operation_ids",
            "fencing_tokens",
            "states",
            "observations",
            "next_poll_delays_s",
            "remote_completed_at_ms",
            "reasons",
            "source_states",
            "outputs",
            "call_ids",
            "call_status_codes",
            "call_outcomes",
            "call_remote_job_ids",
            "call_durations_ms",
        ),
        _save_outcome,
    ),
    BatchedStatement(
        "record_remote_call",
        Q.record_remote_call,
        (
            "operation_ids",
            "call_ids",
            "methods",
            "status_codes",
            "outcomes",
            "remote_job_ids",
            "durations_ms",
            "fencing_tokens",
        ),
        _nothing,
        distinct=False,
    ),
)


#: The name of the outbox relay's transaction-scoped advisory lock (``pg_try_advisory_xact_lock(hashtext(name))``):
#: one relay publishes at a time, across every worker on the database (queries/ledger.sql).
OUTBOX_RELAY_LOCK_NAME = "generation-streams:outbox-relay"
#: Longest :meth:`Ledger.close` waits for its batches and for the pool's connections to come back (s); then the
#: pool is terminated (asyncpg's ``Pool.close`` waits for every connection a task still holds, without limit).
CLOSE_TIMEOUT_S = bounded.CLOSE_TIMEOUT_S

log = logging.getLogger(__name__)


class Ledger(WaitsOutOutages, AnnouncesTransitions, Decisions, Accounting):
    """Typed access to the ledger's named queries (``streams/ledger/queries/ledger.sql``).

    Args:
        pool: from :func:`create_pool`.
        worker: this worker's name, written into the transition log and accounting.

        batching: coalesce the hot path's statements across concurrent tasks (module docstring); False sends
            one statement per call (the same statements, one row each), as a reference for tests and
            measurements.

    Every method raises :class:`LedgerUnavailableError` when PostgreSQL does not answer and
    :class:`LedgerDataError` when it refuses the values; nothing is then written (each method is atomic).
    """

    def __init__(self, pool: asyncpg.Pool, worker: str, *, batching: bool = True) -> None:
        self.pool = pool
        self.worker = worker
        self.batching = batching
        self._batches = Batcher(batching=batching)
        for statement in BATCHED:
            self._batches.stage(statement.name, statement.bind(pool, worker), distinct=statement.distinct)

    async def close(self) -> None:
        """Finish the batches on the wire or queued (at most :data:`CLOSE_TIMEOUT_S`: then they are cancelled, and
        their callers get ``CancelledError``), then close the pool (at most :data:`CLOSE_TIMEOUT_S` again: then it
        is terminated, and a statement still running is rolled back by PostgreSQL); each cut is logged."""
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self._batches.drain()
        except TimeoutError:
            log.warning("the ledger's batches were not done %g s after it began to close; cancelled", CLOSE_TIMEOUT_S)
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self.pool.close()
        except TimeoutError:
            log.warning(
                "the ledger's connections were not all back %g s after its pool began to close; closed under "
                "the statements still running (PostgreSQL rolls them back)",
                CLOSE_TIMEOUT_S,
            )
            self.pool.terminate()

    @writes_transitions
    @waits_out_outages("accept")
    async def accept(
        self, operation_id: str, request_text: str, *, submitted_at_ms: int, source_text: str | None = None
    ) -> bool:
        """Insert the operation as ``accepted``; False when it already existed (a replay).

        ``request_text`` (the provider's request) and ``source_text`` are JSON texts, stored as they are
        (``json``: no number or escape rewritten); ``submitted_at_ms`` is the application's epoch ms.
        """
        request = (operation_id, request_text, submitted_at_ms, source_text)
        inserted: bool = await self._batches.submit("accept", request)
        return inserted

    @writes_transitions
    @waits_out_outages("claim submit")
    async def claim_for_submit(self, operation_id: str, claim_id: uuid.UUID | None = None) -> int | None:
        """``accepted -> submitting`` with a new fencing value, written before the POST.

        ``claim_id`` names this claim (default: a new one). A caller that sends its claim again after
        :class:`LedgerUnavailableError` passes the same id: if the first one was committed (only its reply was
        lost), the repeat returns the fencing value it wrote.

        Returns the fencing value, or None when the operation is past ``accepted`` by another claim (never
        resubmit).

        Raises:
            LedgerUnavailableError: PostgreSQL did not answer; the claim may have been committed.
        """
        fencing: int | None = await self._batches.submit("claim_submit", (operation_id, claim_id or uuid.uuid4()))
        return fencing

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
        """Fenced: save the job id (``submitting|uncertain -> submitted``); False when refused.

        ``first_poll_delay_s``: when the first poll is due (s from now). ``call``: the accounting record of the POST
        that reported the job (``POST``, this operation, job and fencing value), written by the same statement
        whether the save is written or refused, as :meth:`record_remote_call` would (its job's record too). When
        this raises, nothing is written: the caller records the call by itself.

        ``first_poll_claim_id``: the save also claims the job's first poll for this worker, as
        :meth:`claim_for_observe` would with that claim id, and returns it (a :class:`FirstPollClaim`); the poll is
        then due ``first_poll_delay_s`` from now only for another worker (the caller passes its hint plus the
        visibility timeout). True instead (saved, the first poll left to the poll scheduler) when a cancellation is
        recorded, or when this was a repeat and a newer claim was taken since.

        Raises:
            ValueError: ``call`` is not this save's POST.
        """
        _check_call(call, "POST", operation_id, fencing_token, remote_job_id)
        saved: bool | FirstPollClaim = await self._batches.submit(
            "save_submitted",
            (
                operation_id,
                fencing_token,
                remote_job_id,
                first_poll_delay_s,
                first_poll_claim_id,
                reason,
                *_call_fields(call, job=False),
            ),
        )
        return saved

    @waits_out_outages("record late job")
    async def record_late_job(self, operation_id: str, remote_job_id: str) -> str | None:
        """A POST answer's job that :meth:`save_submitted` refused, for an operation already decided (past
        ``submitting`` and ``uncertain``, not observing this job): its accounting record becomes
        ``created_after_decision``. Returns the operation's state when recorded, None when the operation is not
        decided (still ``submitting``/``uncertain``: the reconciler or an operator decides it), already observes
        this job, or the job belongs to another operation."""
        async with guard(f"record late job {remote_job_id} for {operation_id}"):
            state: str | None = await Q.record_late_job.fetchval(
                self.pool, operation_id=operation_id, remote_job_id=remote_job_id, worker=self.worker
            )
        return state

    @writes_transitions
    @waits_out_outages("save without job")
    async def save_submission_without_job(
        self, operation_id: str, fencing_token: int, state: OperationState, reason: str, reason_code: ReasonCode
    ) -> bool:
        """Fenced: ``submitting -> rejected|uncertain`` with ``reason`` and its ``reason_code``; False when
        refused. The same end sent again after :class:`LedgerUnavailableError` (committed, only its reply lost)
        finds it on the row at its fencing value and returns True, writing nothing."""
        if state not in (OperationState.REJECTED, OperationState.UNCERTAIN):
            raise ValueError(f"a submission without a job ends rejected or uncertain, not {state}")
        async with guard(f"save {state} for {operation_id}"):
            saved = await Q.save_submission_without_job.fetchval(
                self.pool,
                operation_id=operation_id,
                fencing_token=fencing_token,
                state=state.value,
                reason=clean_text(reason),
                reason_code=reason_code,
                worker=self.worker,
            )
        return saved is not None

    @writes_transitions
    async def reconcile_stale_submitting(self, stale_after_s: float, batch_size: int) -> list[str]:
        """Mark operations stuck in ``submitting`` as ``uncertain`` (with a reason); returns their ids."""
        async with guard("reconcile submitting"):
            rows = await Q.reconcile_stale_submitting.fetch(
                self.pool, stale_after_s=stale_after_s, batch_size=batch_size, worker=self.worker
            )
        return [row["operation_id"] for row in rows]

    async def stale_accepted(self, stale_after_s: float, batch_size: int) -> list[tuple[str, str]]:
        """Operations still ``accepted`` ``stale_after_s`` seconds after their last change, oldest first, as
        ``(operation_id, request JSON text)``; at most ``batch_size``. Reading claims nothing (see
        ``claim_for_submit``)."""
        async with guard("find stale accepted"):
            rows = await Q.stale_accepted.fetch(self.pool, stale_after_s=stale_after_s, batch_size=batch_size)
        return [(row["operation_id"], row["request"]) for row in rows]

    async def claim_due_polls(
        self, batch_size: int, visibility_timeout_s: float, bound: ClaimBound | None = None
    ) -> list[DuePoll]:
        """Claim at most ``batch_size`` due polls, oldest due first, skipping rows other transactions hold; each
        comes back by itself after ``visibility_timeout_s`` unless an observer takes it sooner. With ``bound``,
        fewer (or none) so the polls claimed and not yet taken stay within it (:class:`ClaimBound`)."""
        polls, _ = await self.claim_due_polls_and_next(batch_size, visibility_timeout_s, bound)
        return polls

    async def claim_due_polls_and_next(
        self, batch_size: int, visibility_timeout_s: float, bound: ClaimBound | None = None
    ) -> tuple[list[DuePoll], float | None]:
        """:meth:`claim_due_polls` and, in the same statement, the ``poll_due_in_s`` :meth:`next_due_in_s` would
        read once the claim committed: (the polls claimed, seconds until the earliest poll is due, negative when one
        is due still, None when no operation is pollable)."""
        async with guard("claim due polls"):
            rows = await Q.claim_due_polls.fetch(
                self.pool,
                batch_size=batch_size,
                visibility_timeout_s=visibility_timeout_s,
                least_in_flight=bound.least if bound else None,
                pace_window_s=bound.pace_window_s if bound else 1.0,
                take_target_s=bound.take_target_s if bound else 0.0,
            )
        polls = [
            DuePoll(r["operation_id"], r["remote_job_id"], r["poll_claim_id"], r["claimed_at_ms"])
            for r in rows
            if r["operation_id"] is not None
        ]
        due_in_s: float | None = rows[-1]["due_in_s"]  # the last row: operation_id NULL, always there
        return polls, due_in_s

    async def next_due_in_s(self, submitting_stale_after_s: float, accepted_stale_after_s: float) -> SchedulerDue:
        """When the poll scheduler has work next (:class:`SchedulerDue`): the earliest due poll, and the earliest
        operation left ``submitting`` / ``accepted`` longer than these ages (s); one round trip."""
        async with guard("read next scheduler work due"):
            row = await Q.next_due_in_s.fetchrow(
                self.pool,
                submitting_stale_after_s=submitting_stale_after_s,
                accepted_stale_after_s=accepted_stale_after_s,
            )
        if row is None:  # never: a SELECT of aggregates returns one row
            return SchedulerDue(None, None)
        return SchedulerDue(row["poll_due_in_s"], row["reconcile_due_in_s"])

    @waits_out_outages("read")
    async def get_operation(self, operation_id: str) -> dict[str, Any] | None:
        """The operation's row as a dict, or None when the ledger does not hold it."""
        async with guard(f"read {operation_id}"):
            row = await Q.get_operation.fetchrow(self.pool, operation_id=operation_id)
        return dict(row) if row is not None else None

    @waits_out_outages("note replay")
    async def note_erased_replay(self, operation_id: str) -> bool:
        """Record that a submission with the id of an erased operation (forgotten or purged) came and was
        dead-lettered (``replayed_at``): ``streams purge --ids-older-than`` counts its horizon from the last one.
        False when the ledger holds no erased operation of that id.

        Raises:
            LedgerUnavailableError: PostgreSQL did not answer (nothing recorded).
        """
        async with guard(f"note a replay of erased {operation_id}"):
            return await Q.note_erased_replay.fetchval(self.pool, operation_id=operation_id) is not None

    @waits_out_outages("claim observe")
    async def claim_for_observe(
        self, operation_id: str, poll_claim_id: int, claim_id: uuid.UUID | None = None
    ) -> ObserveClaim | None:
        """A new fencing value for observing, if the poll is the newest claim, not taken yet, and the job still
        pollable. ``claim_id`` names this claim (default: a new one); a caller that sends it again after
        :class:`LedgerUnavailableError` passes the same id and gets the claim the first one committed.

        Raises:
            LedgerUnavailableError: PostgreSQL did not answer; the claim may have been committed.
        """
        claim: ObserveClaim | None = await self._batches.submit(
            "claim_observe", (operation_id, poll_claim_id, claim_id or uuid.uuid4())
        )
        return claim

    @waits_out_outages("reschedule")
    async def reschedule_poll(self, operation_id: str, poll_claim_id: int, delay_s: float) -> bool:
        """Move the claimed poll to now + ``delay_s``; False when the claim is stale or the job not pollable."""
        rescheduled: bool = await self._batches.submit("reschedule_poll", (operation_id, poll_claim_id, delay_s))
        return rescheduled

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
        """Fenced, conditional save of one GET snapshot (one statement).

        A terminal ``succeeded`` writes the outputs and one outbox row per ``(operation_id, output_id)`` in
        the same statement. Returns :class:`SaveOutcome` (``SAVED_DUE_NOW`` when a cancellation or a callback that
        came during this poll made the next poll due now instead of after ``next_poll_delay_s``); a refusal writes
        nothing but ``call``.

        ``call``: the accounting record of the GET that gave the snapshot (``GET``, this operation and fencing
        value), written by the same statement whether the save is written or refused. When this raises, nothing
        is written: the caller records the call by itself (:meth:`record_remote_call`, the same ``call_id``).

        Raises:
            ValueError: ``call`` is not a GET of this operation at this fencing value.
        """
        _check_call(call, "GET", operation_id, fencing_token)
        new = snapshot.state
        terminal = is_terminal(new)
        reason = None
        if new is OperationState.FAILED and snapshot.error:
            reason = failed_reason(snapshot.error, snapshot.own_message)
        outputs = [
            {"output_id": str(o["id"]), "position": i, "payload": o, "expires_at_ms": snapshot.expires_at_ms(i)}
            for i, o in enumerate(snapshot.outputs)
        ]
        request = (
            operation_id,
            fencing_token,
            new.value,
            _json_text(snapshot.as_observation()),
            None if terminal else next_poll_delay_s,
            snapshot.completed_at_ms if terminal else None,
            reason,
            "{" + ",".join(sources_for(new)) + "}",
            _json_text(outputs),
            *_call_fields(call, job=True),
        )
        outcome: SaveOutcome = await self._batches.submit("save_observation", request)
        return outcome

    @writes_transitions
    @waits_out_outages("save stalled")
    async def save_stalled(
        self, operation_id: str, fencing_token: int, reason: str, last_answer: dict[str, Any]
    ) -> bool:
        """Fenced: a pollable operation -> ``stalled`` with ``reason`` and the raw ``last_answer`` (kept as
        ``last_observation``); nothing polls it until an operator acts. False when refused."""
        async with guard(f"save stalled for {operation_id}"):
            saved = await Q.save_stalled.fetchval(
                self.pool,
                operation_id=operation_id,
                fencing_token=fencing_token,
                reason=clean_text(reason),
                last_answer=last_answer,
                worker=self.worker,
            )
        return saved is not None

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
        """Fenced: the job's GET answered 404. Within ``grace_s`` of saving the job id the poll is rescheduled
        ``next_poll_delay_s`` out; past it the operation becomes ``stalled`` with ``reason`` and ``answer``.

        Returns the state afterwards (``stalled``, or the unchanged pollable state), None when refused.
        """
        async with guard(f"note 404 for {operation_id}"):
            state = await Q.note_not_found.fetchval(
                self.pool,
                operation_id=operation_id,
                fencing_token=fencing_token,
                grace_s=grace_s,
                next_poll_delay_s=next_poll_delay_s,
                reason=clean_text(reason),
                answer=answer,
                worker=self.worker,
            )
        return None if state is None else OperationState(state)

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
        """Fenced: a poll without a usable observation, of the kind ``setback`` (counted as a poll, so the backoff
        grows): ``UNKNOWN_STATUS``, the GET answered a status the client does not know (``answer`` becomes the last
        observation), or ``POLL_FAILURES``, the GET failed (``answer`` kept only when it stalls). The
        ``limit``-th setback of that kind in a row makes the operation ``stalled`` with ``reason`` and ``setback``
        as its code; before that the poll is rescheduled ``next_poll_delay_s`` out (ledger.sql
        ``note_poll_setback``).

        Returns (state afterwards, setbacks of that kind in a row), None when refused. Raises ValueError for a
        ``setback`` outside :data:`~streams.model.codes.POLL_SETBACKS`.
        """
        if setback not in POLL_SETBACKS:
            raise ValueError(f"note_poll_setback: {setback} is not a poll setback (one of {sorted(POLL_SETBACKS)})")
        async with guard(f"note poll setback ({setback}) for {operation_id}"):
            row = await Q.note_poll_setback.fetchrow(
                self.pool,
                operation_id=operation_id,
                fencing_token=fencing_token,
                setback=setback.value,
                setback_limit=limit,
                next_poll_delay_s=next_poll_delay_s,
                reason=clean_text(reason),
                answer=answer,
                worker=self.worker,
            )
        return None if row is None else (OperationState(row["state"]), row["in_a_row"])

    # --- reconciliation by lookup -----------------------------------------------------------------------------

    async def claim_due_lookups(self, batch_size: int, lag_s: float, visibility_timeout_s: float) -> list[LookupClaim]:
        """Claim ``uncertain`` operations due for a lookup (first one ``lag_s`` after becoming uncertain); each
        claim takes a new fencing value and comes back by itself after ``visibility_timeout_s``."""
        async with guard("claim due lookups"):
            rows = await RECONCILE.claim_due_lookups.fetch(
                self.pool,
                batch_size=batch_size,
                lag_s=lag_s,
                visibility_timeout_s=visibility_timeout_s,
                worker=self.worker,
            )
        return [
            LookupClaim(
                r["operation_id"],
                r["fencing_token"],
                r["uncertain_for_s"],
                r["lookup_count"],
                r["accepted_at_ms"],
                frozenset(r["former_job_ids"]),
                r["had_former"],
            )
            for r in rows
        ]

    @writes_transitions
    @waits_out_outages("adopt found job")
    async def adopt_found_job(
        self, claim: LookupClaim, found: list[LookupJob], reason: str, first_poll_delay_s: float
    ) -> bool:
        """Fenced: adopt ``found[0]`` (oldest first) for the claimed operation (``uncertain -> submitted``) and
        give every job found its accounting record (``lookup``, the others ``duplicate``), in one statement.

        Returns True when the transition was written (False: a newer claim or an operator decided meanwhile;
        the accounting records are written all the same).
        """
        if not found:
            raise ValueError("adopt_found_job needs at least one job")
        jobs = [{"job_id": j.job_id, "status": j.status} for j in found]
        async with guard(f"adopt found job for {claim.operation_id}"):
            adopted: bool = await RECONCILE.adopt_found_job.fetchval(
                self.pool,
                operation_id=claim.operation_id,
                fencing_token=claim.fencing_token,
                remote_job_id=found[0].job_id,
                reason=clean_text(reason),
                first_poll_delay_s=first_poll_delay_s,
                jobs_found=jobs,
                worker=self.worker,
            )
        return adopted

    @waits_out_outages("give up lookup")
    async def give_up_lookup(self, claim: LookupClaim, reason: str) -> bool:
        """Fenced: nothing found after the lag; the operation stays ``uncertain`` for a person, ``reason`` first
        in its reason. False when refused."""
        async with guard(f"give up lookup for {claim.operation_id}"):
            row = await RECONCILE.give_up_lookup.fetchval(
                self.pool,
                operation_id=claim.operation_id,
                fencing_token=claim.fencing_token,
                reason=clean_text(reason),
                worker=self.worker,
            )
        return row is not None

    @waits_out_outages("reschedule lookup")
    async def reschedule_lookup(self, claim: LookupClaim, delay_s: float) -> bool:
        """Fenced: try the lookup again ``delay_s`` from now. False when refused."""
        async with guard(f"reschedule lookup for {claim.operation_id}"):
            row = await RECONCILE.reschedule_lookup.fetchval(
                self.pool, operation_id=claim.operation_id, fencing_token=claim.fencing_token, delay_s=delay_s
            )
        return row is not None

    @waits_out_outages("account")
    async def record_remote_call(self, call: RemoteCall) -> None:
        """Accounting: append one remote call attempt with its classified outcome. ``call.call_id`` names the row;
        a caller that sends the same record again after :class:`LedgerUnavailableError` sends the same id, and a
        row already committed is not written twice.

        Raises:
            LedgerUnavailableError: PostgreSQL did not answer; the row may have been written.
        """
        await self._batches.submit(
            "record_remote_call",
            (
                call.operation_id,
                call.call_id,
                call.method,
                call.status_code,
                str(call.outcome),
                call.remote_job_id,
                call.duration_ms,
                call.fencing_token,
            ),
        )

    # --- cancellation (docs/cancellation.md) ---------------------------------------------------------------

    @writes_transitions
    @waits_out_outages("request cancel")
    async def request_cancel(self, operation_id: str, path: CancelPath, actor: str, reason: str) -> CancelAsk:
        """Record that cancellation of ``operation_id`` was asked (by ``actor`` through ``path``, for ``reason``;
        the first ask is kept, a repeat writes nothing) and end an ``accepted`` operation ``canceled`` in the same
        statement, under the operation's row lock: a claim that comes after finds it past ``accepted`` (no POST).
        Any other state keeps going: the observer calls the provider's cancel route once a job id is saved; a job
        being polled has its poll moved to now by the same statement (``poll_made_due``), so the call is made at
        the next scheduler round, not at the job's next scheduled poll.

        Raises:
            LedgerDataError: an empty ``actor`` or ``reason``.
        """
        async with guard(f"request cancel of {operation_id}"):
            row = await CANCELLATIONS.request_cancel.fetchrow(
                self.pool,
                operation_id=operation_id,
                path=str(path),
                actor=clean_text(actor, 200),
                reason=clean_text(reason, 1000),
                worker=self.worker,
            )
        assert row is not None  # one row always
        state = row["state_when_asked"]
        return CancelAsk(
            operation_id,
            None if state is None else OperationState(state),
            row["recorded"],
            row["canceled_now"],
            row["poll_made_due"],
        )

    @waits_out_outages("note cancel call")
    async def note_cancel_call(
        self, operation_id: str, fencing_token: int, outcome: RemoteCallOutcome, answered: bool
    ) -> int | None:
        """Fenced: one call of the provider's cancel route with its classified ``outcome``; ``answered`` (a
        definite answer) stops further calls. Returns the calls made so far, None when refused (a newer claim, or
        already answered)."""
        async with guard(f"note cancel call for {operation_id}"):
            attempts: int | None = await CANCELLATIONS.note_cancel_call.fetchval(
                self.pool,
                operation_id=operation_id,
                fencing_token=fencing_token,
                outcome=str(outcome),
                answered=answered,
            )
        return attempts

    # --- completion callbacks (docs/callbacks.md) ------------------------------------------------------------

    @waits_out_outages("note callback")
    async def note_callback(self, webhook_id: str, remote_job_id: str) -> CallbackNote:
        """Record one verified callback delivery (``webhook_id``, once) for ``remote_job_id`` and make the job's
        poll due now when it is pollable and neither due already nor claimed; a pollable job's poll not due already
        is marked hinted (``hinted_at``), so the save of a poll being observed makes the next one due now
        (queries/callbacks.sql). Idempotent: a repeat of ``webhook_id`` records and changes nothing. Never saves a
        state: that comes from a GET.

        Raises:
            LedgerDataError: an empty ``webhook_id``.
        """
        async with guard(f"note callback for job {remote_job_id}"):
            row = await CALLBACKS.note_callback.fetchrow(
                self.pool, webhook_id=webhook_id, remote_job_id=remote_job_id, worker=self.worker
            )
        assert row is not None  # one row always
        return CallbackNote(row["operation_id"], row["recorded"], row["made_due"], row["hinted"])

    async def announce_transitions(self) -> None:
        """Once the batches on the wire or queued are done, wake every other worker's relay for transitions this
        worker wrote and its relay may not publish now (it stops): one notification (queries/ledger.sql).

        Raises:
            LedgerUnavailableError: PostgreSQL did not answer (the others' relays find the rows at their fallback).
        """
        await self._batches.drain()
        async with guard("announce transitions"):
            await Q.announce_transitions.fetchval(self.pool, channel=OUTBOX_CHANNEL, payload=TRANSITIONS_PAYLOAD)

    async def relay_outbox(
        self,
        batch_size: int,
        publish: Callable[[list[dict[str, Any]]], Awaitable[Collection[int] | None]],
        skip_operation_ids: Sequence[str] = (),
        *,
        probe: bool = False,
    ) -> int | None:
        """Publish one batch of unpublished outbox rows with ``publish`` and mark those it published.

        Only one relay runs at a time (a transaction-scoped advisory lock), which keeps each operation's
        events in order. ``publish`` returns the ids of the rows Kafka acknowledged (or that are done with), None
        for all of them, or raises: then nothing is marked. The rows of ``skip_operation_ids`` are not selected.
        A crash between publish and mark repeats rows with the same ``event_id``.
        ``probe``: first look, in one statement, whether the lock is free and a row waits (``probe_outbox``), and
        open the round's transaction only then: a round that finds nothing or the lock held costs one round trip
        instead of three, one that finds rows one more.
        Returns the number of rows marked, or None when another relay held the lock (no row was looked at).
        """
        if probe:
            async with guard("probe outbox"):
                row = await Q.probe_outbox.fetchrow(
                    self.pool, relay_lock_name=OUTBOX_RELAY_LOCK_NAME, skip_operation_ids=list(skip_operation_ids)
                )
            assert row is not None  # one row always
            if not row["held"]:
                return None
            if not row["pending"]:
                return 0
        async with guard("relay outbox"), self.pool.acquire() as conn, conn.transaction():
            found = await Q.lock_unpublished_outbox.fetch(
                conn,
                relay_lock_name=OUTBOX_RELAY_LOCK_NAME,
                batch_size=batch_size,
                skip_operation_ids=list(skip_operation_ids),
            )
            if not found[0]["held"]:
                return None
            rows = [dict(r) for r in found if r["id"] is not None]
            if not rows:
                return 0
            for row in rows:
                del row["held"]
            published = await publish(rows)
            ids = [r["id"] for r in rows] if published is None else list(published)
            if ids:
                await Q.mark_outbox_published.execute(conn, outbox_ids=ids)
            return len(ids)
