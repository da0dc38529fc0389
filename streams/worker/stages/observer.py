"""The observer: one due-poll event -> Redis lease -> fenced claim -> GET -> renew -> fenced save -> release.

A job's first poll claimed by the save of its job id enters after the claim (:meth:`Observer.observe_first_poll`,
from :mod:`streams.worker.stages.firstpoll`): the lease, then the same steps.

* Lease not acquired: another worker is observing (or this worker's Redis pool was full); the poll is
  rescheduled (same job id), no spin, no failure.
* Redis unavailable: no claim and no GET; the poll comes back after its visibility timeout.
* Rate budget (:mod:`streams.coordination.ratebudget`): after the claim, the GET waits for a slot of the account's GET
  budget, renewing the lease meanwhile; lease lost or Redis unavailable while waiting: no GET (the poll comes
  back after its visibility timeout). Right before the GET the lease is renewed unless it was confirmed recently
  enough to hold through the GET's deadline and the lease margin (the rule: :mod:`streams.coordination.lease`), e.g.
  acquired
  a moment ago with no wait since.
* GET: at most one in flight per job. It runs under the client's overall deadline (shorter than the lease TTL
  by the lease margin) while the lease is renewed every third of its TTL; a renewal that finds the lease lost
  cancels it.
* GET failed with a complete answer or before sending: classified, accounted, counted as a poll (so the backoff
  grows) and as a failed one in a row, and rescheduled with backoff; ``failed_poll_limit`` failures in a row end
  in ``stalled`` (:mod:`streams.worker.stages.stalling`). A 429 is rescheduled after its ``Retry-After`` (which
  also pauses every worker's GETs, up to ``remote_shared_pause_cap_s``) without counting as a failure: the
  account, not the job, is limited.
* GET abandoned after sending (deadline, timeout, connection lost, lease lost, cancelled): the provider may
  still be serving it, so the lease is left to expire (renewed to a full TTL, not released) and the next poll is
  scheduled after it: the job's next GET starts only once the abandoned one has had a full TTL to end. It counts
  as a failed poll like the above (a lease lost during the GET does not: the provider did nothing wrong).
* The job's answers stop making progress (404 past the grace window, an unknown status N times in a row, failed
  GETs N times in a row, older than the maximum observation age): ``stalled``, polling stops
  (:mod:`streams.worker.stages.stalling`).
* Renewal before the save fails (:class:`LeaseLostError`): no save and no further GET for this poll.
* Concurrency budget (:mod:`streams.coordination.running`): a GET answering a terminal status gives the job's
  running-job slot back; any other answer extends it by ``remote_running_slot_ttl_s``.
* A cancellation recorded for the operation (docs/cancellation.md; recording it made the poll due now): before the
  GET, under the lease and the claim, the provider's cancel route is called
  (:meth:`streams.remote.client.RemoteClient.cancel`), accounted (method ``CANCEL``) and noted, fenced, on the
  operation; a definite answer (accepted, already terminal, refused) is never asked again, another (not found,
  429, 5xx, a timeout) is asked again at the next poll, with the poll's backoff, up to ``cancel_attempt_limit``
  calls. The GET that follows observes the job as usual: the state the provider reports
  is saved, so a job that succeeded first stays ``succeeded`` with its outputs, and a canceled one ends
  ``canceled`` with none.
* Completion callbacks on (``callbacks_enabled``, docs/callbacks.md): a job still running is polled again after at
  least ``callback_fallback_poll_interval_s``; its callback makes the poll due at once, and a lost one only delays.
  A callback that came while this poll was being observed (its GET may have read the job just before it ended)
  makes the save leave the next poll due now (``SAVED_DUE_NOW``, once per callback), as a cancellation recorded
  meanwhile does; this worker's poll scheduler is then woken at once.
* Save refused by the fencing value: the result is dropped, counted (``streams_fencing_refusals_total``) and
  logged. A late ``running`` over a saved ``succeeded`` is refused by the state order.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from streams import hooks, logs, metrics
from streams.backoff import next_poll_delay_s
from streams.config import lease_key
from streams.coordination.lease import Lease
from streams.coordination.ratebudget import BudgetKind
from streams.errors import (
    CoordinationBusyError,
    CoordinationError,
    CoordinationUnavailableError,
    InvalidEventError,
    LeaseLostError,
    LedgerDataError,
    RemoteAbandonedError,
    RemoteContractError,
    RemoteError,
    RemoteJobNotFoundError,
    RemoteRateLimitedError,
    RemoteUnknownStatusError,
)
from streams.ledger.records import FirstPollClaim, ObserveClaim, RemoteCall, SaveOutcome
from streams.model.answers import JobSnapshot, clean_text
from streams.model.codes import RemoteCallOutcome
from streams.model.states import OperationState, is_terminal
from streams.wire import contracts
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.stalling import StallGuard
from streams.worker.wakeup import WRITTEN

log = logging.getLogger(__name__)

POLLS_TOPIC = "generation.polls"


def _failed(job_id: str, code: str, message: str) -> JobSnapshot:
    """A ``failed`` snapshot standing for an answer that cannot be used as it is."""
    return JobSnapshot(
        job_id=job_id,
        status="failed",
        state=OperationState.FAILED,
        error={"code": code, "message": clean_text(message, 1000)},
        own_message=clean_text(message, 1000),
    )


class Observer:
    """Handles ``generation.polls`` events for one worker (see module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.stalls = StallGuard(runtime)

    async def handle(self, message: RawMessage) -> None:
        """Process one raw poll event; invalid input or an unknown operation goes to the dead-letter topic."""
        rt = self.rt
        try:
            event = contracts.decode(POLLS_TOPIC, message.value, rt.settings.max_value_bytes)
        except InvalidEventError as exc:
            await rt.dead_letter(message, exc)
            return
        operation_id: str = event["operation_id"]
        logs.bind(operation_id=operation_id)
        poll_claim_id: int = event["poll_claim_id"]
        lease = await self._lease(operation_id, poll_claim_id)
        if lease is None:
            return
        claim_id = uuid.uuid4()  # the same through the ledger's repeats: a repeat gets the claim it committed
        try:
            claim = await rt.ledger.claim_for_observe(operation_id, poll_claim_id, claim_id)
            if claim is None:
                await self._not_claimed(message, operation_id)
                return
            logs.bind(fencing_token=claim.fencing_token, remote_job_id=claim.remote_job_id)
            await self._observe(operation_id, poll_claim_id, claim, lease)
        finally:
            await lease.release()  # a no-op when a GET was abandoned: the lease is then left to expire

    async def observe_first_poll(self, operation_id: str, first: FirstPollClaim) -> None:
        """Observe a job's first poll, claimed by the save of its job id in this worker
        (:mod:`streams.worker.stages.firstpoll`): as :meth:`handle` does once the poll event is claimed, under the
        same lease; the claim was taken before the lease, so a newer claim (a callback's or a cancellation's poll,
        the visibility timeout) refuses this poll's saves by its fencing value."""
        logs.bind(
            operation_id=operation_id,
            fencing_token=first.claim.fencing_token,
            remote_job_id=first.claim.remote_job_id,
        )
        lease = await self._lease(operation_id, first.poll_claim_id)
        if lease is None:
            return
        try:
            await self._observe(operation_id, first.poll_claim_id, first.claim, lease)
        finally:
            await lease.release()

    async def _lease(self, operation_id: str, poll_claim_id: int) -> Lease | None:
        """The observe lease of ``operation_id``; None when Redis is unavailable (the visibility timeout brings the
        poll back) or another holder has it (the poll claimed as ``poll_claim_id`` is rescheduled: no spin)."""
        rt = self.rt
        try:
            lease = await rt.leases.acquire(lease_key(rt.settings, "observe", operation_id))
        except CoordinationUnavailableError as exc:
            metrics.COORDINATION_UNAVAILABLE.labels("observe").inc()
            rt.log_outage("Redis", exc)
            return None  # no claim and no GET without a lease; the visibility timeout brings the poll back
        if lease is None:
            metrics.LEASE_BUSY.labels("observe").inc()
            await self._reschedule(operation_id, poll_claim_id, rt.settings.lease_busy_retry_s)
        return lease

    async def _not_claimed(self, message: RawMessage, operation_id: str) -> None:
        """A poll that claims nothing: stale (counted), or for an unknown operation (dead-lettered)."""
        row = await self.rt.ledger.get_operation(operation_id)
        if row is None:
            error = InvalidEventError(
                "unknown_operation",
                f"operation {operation_id!r} is not in the ledger; the event goes to the dead-letter topic",
            )
            await self.rt.dead_letter(message, error)
        else:
            metrics.STALE_POLLS.inc()

    async def _reschedule(self, operation_id: str, poll_claim_id: int, delay_s: float) -> None:
        if await self.rt.ledger.reschedule_poll(operation_id, poll_claim_id, delay_s):
            self.rt.wakeups.polls.due_in(delay_s)

    def _delay(self, poll_count: int, hint_s: float | None) -> float:
        s = self.rt.settings
        return next_poll_delay_s(
            poll_count,
            hint_s,
            base_s=s.poll_backoff_base_s,
            cap_s=s.poll_backoff_cap_s,
            min_s=s.poll_min_delay_s,
            hints_trusted_polls=s.poll_hint_trusted_polls,
        )

    async def _renewed(self, lease: Lease, operation_id: str, what: str, *, if_due: bool = False) -> bool:
        """Renew ``lease`` before ``what`` (``if_due``: only when :meth:`Lease.renew_if_due` would); False (logged
        and counted by cause) when it cannot be confirmed."""
        try:
            if if_due:
                await lease.renew_if_due()
            else:
                await lease.renew()
            return True
        except (LeaseLostError, CoordinationUnavailableError, CoordinationBusyError) as exc:
            self._not_confirmed(operation_id, what, exc)
            return False

    def _not_confirmed(self, operation_id: str, what: str, exc: CoordinationError) -> None:
        """Count and log why the lease could not be confirmed, so that ``what`` is not done: lost (counted,
        WARNING), Redis unavailable (counted, logged as an outage) or this worker's Redis pool full (INFO)."""
        if isinstance(exc, LeaseLostError):
            metrics.LEASE_LOST.labels("observe").inc()
            log.warning("%s: %s", what, exc)
        elif isinstance(exc, CoordinationUnavailableError):
            metrics.COORDINATION_UNAVAILABLE.labels("observe").inc()
            self.rt.log_outage("Redis", exc)
        else:
            log.info("%s: %s", what, exc)

    async def _observe(self, operation_id: str, poll_claim_id: int, claim: ObserveClaim, lease: Lease) -> None:
        rt = self.rt
        poll_count = claim.poll_count
        claimed_at = time.monotonic()
        if claim.cancel_asked and not claim.cancel_answered:
            await self._cancel_at_provider(operation_id, claim, lease)
        if not await self._get_slot(operation_id, lease):
            return
        # The claim or the budget may have waited (a PostgreSQL outage): still ours before the GET? (If not, the
        # poll comes back after its visibility timeout.) Not asked when confirmed recently enough
        # (streams.coordination.lease).
        if not await self._renewed(lease, operation_id, "no GET", if_due=True):
            return
        got = await self._get(operation_id, poll_claim_id, poll_count, claim, lease, claimed_at)
        if got is None:
            return
        snapshot, call = got
        pending = [] if call is None else [call]  # the GET's accounting record, until a save carries it
        try:
            await self._keep(operation_id, poll_claim_id, claim, lease, claimed_at, snapshot, pending)
        finally:
            if pending:  # no save carried it (not saved, or refused as a value): recorded by itself
                await rt.ledger.record_remote_call(pending[0])

    async def _keep(
        self,
        operation_id: str,
        poll_claim_id: int,
        claim: ObserveClaim,
        lease: Lease,
        claimed_at: float,
        snapshot: JobSnapshot,
        pending: list[RemoteCall],
    ) -> None:
        """Save the GET's ``snapshot`` (or stall the job, or leave it to the visibility timeout when the lease is
        lost); ``pending`` holds the GET's accounting record (when not written yet), taken out once a save wrote it
        (saved or refused)."""
        rt = self.rt
        poll_count = claim.poll_count
        if is_terminal(snapshot.state):  # the job no longer runs at the provider: its slot is free
            await rt.running.release(operation_id)
        else:
            await rt.running.refresh(operation_id)
        if not await self._renewed(lease, operation_id, "not saving the GET result"):
            return
        # A worker can be paused right here, after a successful renewal: only the fencing value protects the
        # save below. A test harness makes that pause happen on purpose here (streams/hooks.py).
        hooks.reach(hooks.HookPoint.OBSERVED_BEFORE_SAVE, operation_id=operation_id)
        if not is_terminal(snapshot.state) and self.stalls.too_old(claim, claimed_at):
            await self.stalls.stall_too_old(operation_id, claim, snapshot.as_observation())
            return
        delay = self._delay(poll_count, snapshot.poll_after_s)
        if rt.settings.callbacks_enabled:  # the job's callback makes its poll due sooner (docs/callbacks.md)
            delay = max(delay, rt.settings.callback_fallback_poll_interval_s)
        try:
            call = pending[0] if pending else None
            outcome = await rt.ledger.save_observation(operation_id, claim.fencing_token, snapshot, delay, call)
            pending.clear()  # its accounting record written by the save
        except LedgerDataError as exc:  # e.g. a NUL in an output: the answer cannot be stored as it is
            log.error("the remote answer cannot be stored (%s); recording failed", exc)
            if pending:  # the save wrote nothing: the GET recorded by itself
                await rt.ledger.record_remote_call(pending.pop())
            unstorable = _failed(snapshot.job_id, "unstorable_response", str(exc))
            outcome = await rt.ledger.save_observation(operation_id, claim.fencing_token, unstorable, None)
        if outcome is SaveOutcome.SAVED_DUE_NOW:  # a cancellation or a callback came during this poll
            rt.wakeups.polls.notify(WRITTEN)
        elif outcome is SaveOutcome.SAVED:
            if snapshot.outputs and snapshot.state is OperationState.SUCCEEDED:
                rt.wakeups.outbox.notify(WRITTEN)  # outputs in the outbox (a transition alone waits for a round)
            elif not is_terminal(snapshot.state):
                rt.wakeups.polls.due_in(delay)
        elif outcome is SaveOutcome.REFUSED_FENCING:
            metrics.FENCING_REFUSALS.labels("observe").inc()
            log.warning(
                "observation %s dropped: fencing value %s is stale (a newer claim saved since)",
                snapshot.status,
                claim.fencing_token,
            )
        elif outcome is SaveOutcome.REFUSED_ORDER:
            metrics.ORDER_REFUSALS.inc()
            log.info("%s not saved over a later state", snapshot.status)
            if snapshot.outputs and snapshot.state is OperationState.SUCCEEDED:
                # e.g. this save committed, its answer was lost and its retry refused: its outputs may be waiting
                rt.wakeups.outbox.notify(WRITTEN)
            await self._reschedule(operation_id, poll_claim_id, delay)  # still pollable: poll again soon

    async def _cancel_at_provider(self, operation_id: str, claim: ObserveClaim, lease: Lease) -> None:
        """Call the provider's cancel route for the claimed job under ``lease`` (renewed during the call), account
        the call and note its answer, fenced (module docstring). Past ``cancel_attempt_limit`` calls without a
        definite answer it is not called again (logged at each poll)."""
        rt = self.rt
        job_id = claim.remote_job_id
        limit = rt.settings.cancel_attempt_limit
        if claim.cancel_attempts >= limit:
            log.error(
                "cancel of job %s not asked again: %d calls without a definite answer "
                "(cancel_attempt_limit); the job is observed until it ends (docs/cancellation.md)",
                job_id,
                claim.cancel_attempts,
            )
            return
        if not await self._renewed(lease, operation_id, "no cancel call", if_due=True):
            return
        try:
            result = await lease.renewing(rt.remote.cancel(operation_id, job_id))
        except LeaseLostError as exc:
            metrics.LEASE_LOST.labels("observe").inc()
            log.warning("cancel of job %s cut off (%s); asked again at the next poll", job_id, exc)
            return
        fencing = claim.fencing_token
        call = RemoteCall(
            operation_id, "CANCEL", result.status_code, result.outcome, job_id, result.duration_ms, fencing
        )
        await rt.account(call)
        attempts = await rt.ledger.note_cancel_call(operation_id, fencing, result.outcome, result.definite)
        if result.definite:
            log.info("%s: %s; observing the job until it ends", result.detail, result.outcome)
        else:
            log.warning(
                "%s: %s (call %s of at most %d); asked again at the next poll",
                result.detail,
                result.outcome,
                attempts if attempts is not None else "?",
                limit,
            )

    async def _get_slot(self, operation_id: str, lease: Lease) -> bool:
        """Wait for a GET slot of the account's rate budget, renewing ``lease`` meanwhile. False (counted, logged)
        when the lease was lost, Redis did not answer or this worker's Redis pool was full: then no GET (the poll
        comes back after its visibility timeout)."""
        try:
            await self.rt.budget.wait_for_slot(
                BudgetKind.GET, keep_alive=lease.renew, keep_alive_every_s=lease.ttl_ms / 3000
            )
            return True
        except (LeaseLostError, CoordinationUnavailableError, CoordinationBusyError) as exc:
            self._not_confirmed(operation_id, "no GET (waiting for the rate budget)", exc)
            return False

    async def _get(
        self,
        operation_id: str,
        poll_claim_id: int,
        poll_count: int,
        claim: ObserveClaim,
        lease: Lease,
        claimed_at: float,
    ) -> tuple[JobSnapshot, RemoteCall | None] | None:
        """GET the job under ``lease`` (renewed during the call); on a classified failure account it, reschedule
        (or stall), and return None. An abandoned GET leaves the lease to expire and polls again only after it.

        Returns the snapshot to save and, for an answer, its call (counted in the metrics, not yet in the ledger:
        the save writes it); None as the call of a failed snapshot made from a contract violation (accounted)."""
        rt = self.rt
        job_id = claim.remote_job_id
        started = time.perf_counter()
        try:
            snapshot = await lease.renewing(rt.remote.observe(operation_id, job_id))
        except (RemoteAbandonedError, LeaseLostError) as exc:
            duration_ms = (time.perf_counter() - started) * 1000.0
            await self._abandoned(operation_id, poll_claim_id, poll_count, claim, lease, exc, duration_ms, claimed_at)
            return None
        except asyncio.CancelledError:  # cancelled mid-GET (rebalance, shutdown): the GET may still be in flight
            lease.keep_until_expiry()  # not released; the visibility timeout brings the poll back after it
            raise
        except RemoteError as exc:
            await rt.account_failure(operation_id, "GET", exc, started, job_id, claim.fencing_token)
            failed = await self._get_failed(operation_id, poll_claim_id, poll_count, claim, exc, claimed_at)
            return None if failed is None else (failed, None)
        answered = RemoteCallOutcome.answered(snapshot.state)
        fencing = claim.fencing_token
        call = RemoteCall(operation_id, "GET", snapshot.status_code, answered, job_id, snapshot.duration_ms, fencing)
        rt.count_call(call)
        return snapshot, call

    async def _get_failed(
        self,
        operation_id: str,
        poll_claim_id: int,
        poll_count: int,
        claim: ObserveClaim,
        exc: RemoteError,
        claimed_at: float,
    ) -> JobSnapshot | None:
        """Where a GET that failed with a classified answer goes (accounted already): a 404 or an unknown status to
        the stall guard (rescheduled, or ``stalled``), an answer that breaks the API's contract to a ``failed``
        snapshot (returned, saved like an answer), a 429 to another poll after its ``Retry-After`` (which pauses every
        worker's GETs), anything else to the stall guard as a failed poll (another poll with backoff, or ``stalled``
        at ``failed_poll_limit`` in a row); a job too old to poll is ``stalled``."""
        if isinstance(exc, RemoteJobNotFoundError):
            log.info("%s", exc)
            await self.stalls.not_found(operation_id, claim, exc, self._delay(poll_count, None))
            return None
        if isinstance(exc, RemoteUnknownStatusError):
            log.warning("%s", exc)
            await self.stalls.unknown_status(operation_id, claim, exc, self._delay(poll_count, None))
            return None
        if isinstance(exc, RemoteContractError):
            log.error("%s; recording it as failed", exc)
            return _failed(claim.remote_job_id, "contract_violation", str(exc))
        if self.stalls.too_old(claim, claimed_at):
            await self.stalls.stall_too_old(operation_id, claim, {"error": clean_text(str(exc), 1000)})
            return None
        if isinstance(exc, RemoteRateLimitedError):
            await self.rt.budget.note_rate_limited(BudgetKind.GET, exc.retry_after_s)
            log.info("GET %s, retrying: %s", exc.outcome, exc)
            await self._reschedule(operation_id, poll_claim_id, self._delay(poll_count, exc.retry_after_s))
            return None
        delay = self._delay(poll_count, None)
        log.info("GET %s, retrying in %.1f s: %s", exc.outcome, delay, exc)
        await self.stalls.failed_poll(operation_id, claim, exc, delay)
        return None

    async def _abandoned(
        self,
        operation_id: str,
        poll_claim_id: int,
        poll_count: int,
        claim: ObserveClaim,
        lease: Lease,
        exc: Exception,
        duration_ms: float,
        claimed_at: float,
    ) -> None:
        """A GET cut off after it was sent: keep other workers off the job (the lease, renewed to a full TTL, is
        left to expire) and poll again only after the lease is gone (or stall it when it is too old to poll)."""
        rt = self.rt
        metrics.ABANDONED_CALLS.labels("GET").inc()
        if isinstance(exc, LeaseLostError):
            metrics.LEASE_LOST.labels("observe").inc()
        quarantine_s = await lease.leave_to_expire()
        status = exc.status_code if isinstance(exc, RemoteError) else None
        job_id = claim.remote_job_id
        await rt.account(
            RemoteCall(
                operation_id, "GET", status, RemoteCallOutcome.ABANDONED, job_id, duration_ms, claim.fencing_token
            )
        )
        if self.stalls.too_old(claim, claimed_at):
            await self.stalls.stall_too_old(operation_id, claim, {"error": clean_text(str(exc), 1000)})
            return
        log.warning(
            "GET %s abandoned (%s); lease %s left to expire, next poll in %.1f s",
            job_id,
            exc,
            lease.key,
            quarantine_s,
        )
        delay = max(quarantine_s, self._delay(poll_count, None))
        if isinstance(exc, RemoteAbandonedError):
            await self.stalls.failed_poll(operation_id, claim, exc, delay)
        else:
            await self._reschedule(operation_id, poll_claim_id, delay)
