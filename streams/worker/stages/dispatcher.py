"""The dispatcher: one submission event -> ``accepted`` -> ``submitting`` (written first) -> one POST.

Outcome of the POST (see :mod:`streams.remote.client`):

* created (2xx, or 502 with ``error.job_id``): the job id is saved, fenced; the first poll is scheduled, or, when
  its hint is short and this worker has room, claimed by the same statement and taken here
  (:mod:`streams.worker.stages.firstpoll`).
* definite refusal (4xx): ``rejected`` with the API's reason.
* 429 or "not sent" (connection refused before any byte): retried after ``Retry-After`` / with backoff,
  within ``submit_retry_deadline_s``; past it (or at once, for a ``Retry-After`` ending past it), ``rejected``
  (nothing was ever created).
* unknown outcome (timeout or connection lost after send, 5xx without job id): ``uncertain`` with the reason;
  never re-sent. A replayed submission never POSTs again once the operation left ``accepted``.
* a cancellation recorded before the claim (docs/cancellation.md): the claim itself ends the operation
  ``canceled`` (``accepted -> canceled``, under the same row lock) and no POST is sent.

The request is the provider's request body, carried as JSON text from the Kafka event to the ledger and the
POST body (:func:`streams.remote.client.provider_request_body` adds ``metadata.client_reference`` and a default
``model``); a replay of the same operation id with a request of another meaning is dead-lettered.

A submit lease (Redis) is held around the claim and the POST: with Redis down no claim and no POST happen;
the event waits (its offset is not committed) and resumes by itself.

From the claim to the saved outcome the work runs in its own task, shielded from the cancellation of the
handler (a worker stopping, an actor restarted): once ``submitting`` is written, the POST is sent and its
answer saved even if the event's handler is cancelled before the request, between request and answer, or
between answer and save. Only the death of the process leaves ``submitting`` without an outcome, which the
reconciler turns into ``uncertain`` after ``submitting_stale_after_s``.

:meth:`Dispatcher.redispatch` dispatches an operation found still ``accepted`` long after it was accepted
(see :mod:`streams.worker.stages.scheduler`): nothing was sent for it, and it goes through the same submit lease and the
same fenced claim (``accepted -> submitting``), so a live dispatcher and a re-dispatch never both POST.

Rate budget (:mod:`streams.coordination.ratebudget`): the first POST's slot is waited for under the submit lease
(renewed
meanwhile) *before* the claim, so a long wait leaves the operation ``accepted`` (nothing to reconcile) and the
event simply waits; the claim follows at once and the POST right after it. A slot older than
:data:`SLOT_VALID_S` by then (the claim waited out PostgreSQL), and every retry's slot, is waited for inside the
claim within the retry deadline; past it the operation ends ``rejected`` (nothing was sent). No wait ever
follows a POST: waits come first, then the call and its deadline. A 429 pauses every worker's POSTs for its
``Retry-After``.

Concurrency budget (:mod:`streams.coordination.running`): before the POST slot, the operation waits under the
submit lease (renewed meanwhile) for a running-job slot of the account and of its model (the request's ``model``,
else ``remote_model``), polling every :data:`RUNNING_SLOT_RETRY_S` (jittered); the event waits meanwhile, and
the operation stays ``accepted``. A POST ending ``rejected`` gives the slot back; one ending ``uncertain`` keeps it
until it lapses (a job may exist). A replayed submission of an operation already past ``accepted`` takes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tenacity

from streams import logs, metrics
from streams.config import lease_key
from streams.coordination.lease import Lease
from streams.coordination.ratebudget import BudgetKind, KeptAliveSleep
from streams.errors import (
    CoordinationBusyError,
    CoordinationUnavailableError,
    InvalidEventError,
    LeaseLostError,
    LedgerDataError,
    RateBudgetDeadlineError,
    RemoteError,
    RemoteNotSentError,
    RemoteRateLimitedError,
    RemoteRefusedError,
    RemoteUnknownOutcomeError,
)
from streams.ledger.records import FirstPollClaim, RemoteCall
from streams.model.codes import ReasonCode, RemoteCallOutcome
from streams.model.states import OperationState
from streams.remote.client import SubmitResult
from streams.retrying import failure_of, first_attempt_plain, retry_without_deadline
from streams.wire import contracts, exactjson, jsontext
from streams.worker.runtime import RawMessage, Runtime

if TYPE_CHECKING:
    from streams.worker.stages.firstpoll import FirstPolls

log = logging.getLogger(__name__)

SUBMISSIONS_TOPIC = "generation.submissions"

#: The ledger's request of an erased operation (``streams purge``, ``streams operations forget``: JSON null), never a
#: submission's (the schema wants an object).
ERASED_REQUEST = "null"

#: A POST slot of the rate budget is used at most this long after it was granted (s). Between the slot and the
#: POST lie the claim and a lease renewal (milliseconds; a few hundred on a starved machine); an older slot means
#: the claim waited out an outage, as did every other dispatcher's: it is dropped and a new one waited for, so the
#: delayed POSTs do not all go at once. Shorter would spend two slots on one POST whenever the machine is slow.
SLOT_VALID_S = 1.0

#: Claims and POSTs running shielded from their handler's cancellation (strong references: asyncio keeps
#: only weak ones to tasks).
_SHIELDED: set[asyncio.Task[bool]] = set()

#: Wait (s) between two asks for a running-job slot while the account or the model is full, plus up to as much
#: again at random so that waiting dispatchers do not all ask Redis at once: a slot freed is taken within it.
RUNNING_SLOT_RETRY_S = 0.2


def _log_failure(task: asyncio.Task[bool]) -> None:
    _SHIELDED.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("a shielded submission ended with an error", exc_info=task.exception())


def _wait_for_retry(base: tenacity.wait.wait_base, deadline: float) -> tenacity.wait.wait_base:
    """Wait the 429's ``Retry-After`` when given, else the exponential ``base`` wait; never past ``deadline``
    (``time.monotonic()`` seconds; the next attempt then finds the budget spent and the POST ends ``rejected``)."""

    class _Wait(tenacity.wait.wait_base):
        def __call__(self, retry_state: tenacity.RetryCallState) -> float:
            exc = retry_state.outcome.exception() if retry_state.outcome else None
            wanted = exc.retry_after_s if isinstance(exc, RemoteRateLimitedError) else base(retry_state)
            remaining = deadline - time.monotonic()
            return max(0.0, min(wanted, remaining + 0.01))

    return _Wait()


def _stop_at(deadline: float) -> Callable[[tenacity.RetryCallState], bool]:
    """A tenacity stop: no attempt once ``time.monotonic()`` reached ``deadline`` (what ``stop_after_delay`` does,
    counted from a start of our choosing rather than from the policy's first attempt), nor after a 429 whose
    ``Retry-After`` ends at or past ``deadline`` (no POST may follow within it: the 429 ends the operation now,
    ``rejected`` as rate limited, rather than after waiting out the deadline)."""

    def stop(retry_state: tenacity.RetryCallState) -> bool:
        now = time.monotonic()
        failure = failure_of(retry_state)
        if isinstance(failure, RemoteRateLimitedError) and now + failure.retry_after_s >= deadline:
            return True
        return now >= deadline

    return stop


#: The POST failures that are retried within ``submit_retry_deadline_s``: nothing was created.
_RETRIED = (RemoteRateLimitedError, RemoteNotSentError)


class _NoLongerOurs(Exception):
    """The operation left ``submitting`` under our fencing value while we waited to retry: stop, send nothing."""


class _LeaseHeld(Exception):
    """Another holder has the submit lease ``args[0]`` (and we still need it): wait, then take it again."""


def request_model(request_text: str, default_model: str) -> str:
    """The model a request names (its top-level ``model`` string), else ``default_model`` (what the POST sends:
    :func:`streams.remote.client.provider_request_body`)."""
    text = jsontext.member_texts(request_text).get("model")
    value = exactjson.loads(text) if text is not None else None
    return value if isinstance(value, str) else default_model


def request_digest(request: Any) -> str:
    """A short digest (16 hex characters of SHA-256) of a request's canonical form
    (:func:`streams.wire.jsontext.canonical`; ``request`` as :func:`streams.wire.exactjson.loads` reads it): equal for
    two
    requests that mean the same JSON."""
    return hashlib.sha256(jsontext.canonical(request).encode()).hexdigest()[:16]


class Dispatcher:
    """Handles ``generation.submissions`` events for one worker (see module docstring)."""

    def __init__(self, runtime: Runtime, first_polls: FirstPolls | None = None) -> None:
        self.rt = runtime
        #: Takes the first poll of a job with a short hint in this worker (None: the scheduler takes every one).
        self.first_polls = first_polls

    async def handle(self, message: RawMessage) -> None:
        """Process one raw submission event; invalid input goes to the dead-letter topic."""
        settings = self.rt.settings
        try:
            event = contracts.decode(SUBMISSIONS_TOPIC, message.value, settings.max_value_bytes)
        except InvalidEventError as exc:
            metrics.SUBMISSIONS.labels("dead_letter").inc()
            await self.rt.dead_letter(message, exc)
            return
        operation_id: str = event["operation_id"]
        logs.bind(operation_id=operation_id)
        if message.key != operation_id.encode():
            await self._reject_input(
                message,
                "key_mismatch",
                f"record key {message.key!r} is not the operation id "
                f"{operation_id!r}: every topic is keyed by operation id",
            )
            return
        assert message.value is not None  # decode refuses a tombstone
        parts = jsontext.member_texts(message.value.decode("utf-8"))
        request_text = parts["request"]
        accepted = await self.rt.ledger.accept(
            operation_id, request_text, submitted_at_ms=event["submitted_at_ms"], source_text=parts.get("source")
        )
        if not accepted:  # a replay: it must ask for the same request (canonical forms, not texts, compared)
            row = await self.rt.ledger.get_operation(operation_id)
            previous = request_digest(exactjson.loads(row["request"])) if row is not None else None
            if previous is not None and previous != request_digest(event["request"]):
                erased = row is not None and row["request"] == ERASED_REQUEST
                if erased and not await self.rt.ledger.note_erased_replay(operation_id):
                    # its copies on the topics keep the id taken a while longer; gone meanwhile: purge freed it
                    log.warning("a replay of erased operation %s met no erased row to note it on", operation_id)
                await self._reject_input(
                    message,
                    "conflicting_duplicate",
                    f"operation {operation_id} was erased (by streams purge or streams operations forget: its "
                    "request is gone, its id stays taken), so a submission with its id is refused: a new request "
                    "needs a new operation id"
                    if erased
                    else f"operation {operation_id} was accepted with another request (canonical digest "
                    f"{previous}); this submission's request differs (digest {request_digest(event['request'])}): "
                    "a different request needs a new operation id",
                )
                return
            if row is not None and row["state"] != OperationState.ACCEPTED:  # dispatched already: take no slot
                metrics.SUBMISSIONS.labels("already_dispatched").inc()
                return
        model = request_model(request_text, settings.remote_model)
        ready = await self._lease_and_post_slot(operation_id, model)
        if ready is None:
            metrics.SUBMISSIONS.labels("already_dispatched").inc()
            return
        lease, slot_at = ready
        await self._claim_and_submit_shielded(operation_id, request_text, lease, slot_at)

    async def redispatch(self, operation_id: str, request_text: str) -> bool:
        """Dispatch an operation left ``accepted`` (its event was handled by a worker that died before the claim,
        or was never read again); ``request_text`` is the ledger's ``request`` (JSON text as submitted).

        Takes the submit lease without waiting (held: someone is dispatching it, returns False), waits for a POST
        slot of the rate budget under it (lease lost meanwhile: returns False), then makes the same fenced claim
        as :meth:`handle` (already past ``accepted``: returns False). Returns True when this call claimed the
        operation and submitted it.
        """
        logs.bind(operation_id=operation_id)  # this re-dispatch's own task (the scheduler starts one per operation)
        key = lease_key(self.rt.settings, "submit", operation_id)
        try:
            lease = await self.rt.leases.acquire(key)
        except CoordinationUnavailableError as exc:
            metrics.COORDINATION_UNAVAILABLE.labels("submit").inc()
            self.rt.log_outage("Redis", exc)
            return False
        if lease is None:
            metrics.LEASE_BUSY.labels("submit").inc()
            return False
        model = request_model(request_text, self.rt.settings.remote_model)
        slot_at = await self._post_slot_before_claim(operation_id, lease, model)  # the budgets, before the claim
        if slot_at is None:  # the lease was lost while waiting: someone else may dispatch it
            return False
        claimed = await self._claim_and_submit_shielded(operation_id, request_text, lease, slot_at)
        if claimed:
            metrics.SUBMISSIONS.labels("redispatched").inc()
            log.warning(
                "found still accepted after %.0f s; dispatched again from the ledger",
                self.rt.settings.accepted_stale_after_s,
            )
        return claimed

    async def _claim_and_submit_shielded(
        self, operation_id: str, request_text: str, lease: Lease, slot_at: float | None = None
    ) -> bool:
        """Claim (``accepted -> submitting``), POST and save in a task the caller's cancellation does not
        cancel; the caller still sees its own ``CancelledError``. Returns False when the claim found the
        operation past ``accepted``. Releases ``lease`` in every case."""
        task = asyncio.ensure_future(self._claim_and_submit(operation_id, request_text, lease, slot_at))
        _SHIELDED.add(task)
        task.add_done_callback(_log_failure)
        return await asyncio.shield(task)

    async def _claim_and_submit(
        self, operation_id: str, request_text: str, lease: Lease, slot_at: float | None = None
    ) -> bool:
        claim_id = uuid.uuid4()  # the same through the ledger's repeats: a repeat gets the claim it committed
        try:
            fencing = await self.rt.ledger.claim_for_submit(operation_id, claim_id)
        except BaseException:
            await lease.release()
            raise
        if fencing is None:
            await lease.release()
            row = await self.rt.ledger.get_operation(operation_id)
            if row is not None and row["state"] == OperationState.CANCELED and row["remote_job_id"] is None:
                log.info("canceled before the POST (%s); no POST sent", row["reason"])
            metrics.SUBMISSIONS.labels("already_dispatched").inc()
            return False
        logs.bind(fencing_token=fencing)
        await self._submit(operation_id, request_text, fencing, lease, slot_at)
        return True

    async def _reject_input(self, message: RawMessage, reason: str, text: str) -> None:
        metrics.SUBMISSIONS.labels("dead_letter").inc()
        await self.rt.dead_letter(message, InvalidEventError(reason, text))

    async def _take_submit_lease(self, operation_id: str) -> Lease | None:
        """The submit lease, waiting while another holder has it and the operation is still ``accepted``
        (``lease_busy_retry_s`` between two attempts; Redis outages waited out by :meth:`Runtime.acquire_waiting`).

        Returns None once the operation is past ``accepted`` (someone else dispatched it).
        """
        key = lease_key(self.rt.settings, "submit", operation_id)

        async def take() -> Lease | None:
            lease = await self.rt.acquire_waiting(key, "submit")
            if lease is not None:
                return lease
            metrics.LEASE_BUSY.labels("submit").inc()
            row = await self.rt.ledger.get_operation(operation_id)
            if row is None or row["state"] != OperationState.ACCEPTED:
                return None
            raise _LeaseHeld(key)

        return await retry_without_deadline(take, retry_on=_LeaseHeld, wait=self._lease_busy_wait())

    async def _lease_and_post_slot(self, operation_id: str, model: str) -> tuple[Lease, float] | None:
        """The submit lease, a running-job slot for ``model`` and a POST slot of the rate budget taken under it
        (its ``time.monotonic()``), or None once the operation is past ``accepted`` (someone else dispatched it)."""
        while True:
            lease = await self._take_submit_lease(operation_id)
            if lease is None:
                return None
            slot_at = await self._post_slot_before_claim(operation_id, lease, model)
            if slot_at is not None:
                return lease, slot_at

    async def _post_slot_before_claim(self, operation_id: str, lease: Lease, model: str) -> float | None:
        """Wait for a running-job slot for ``model`` (:meth:`_running_slot`), then a POST slot of the rate budget,
        under ``lease`` (renewed meanwhile), before any claim.

        Returns the ``time.monotonic()`` of the slot with the lease confirmed, or None when the lease was lost
        while waiting (released; nothing claimed, nothing sent: take it again). Redis unavailable or this worker's
        Redis pool full: counted, reported (:meth:`Runtime.report_failure`) and asked again after
        :meth:`Runtime.redis_retry_wait`, without a deadline. Any other exit (an error, a cancellation) releases
        the lease.
        """

        async def slot() -> float:
            await self._running_slot(operation_id, model, lease)
            await self.rt.budget.wait_for_slot(
                BudgetKind.POST, keep_alive=lease.renew, keep_alive_every_s=lease.ttl_ms / 3000
            )
            await lease.renew_if_due()  # still ours right before the claim (unless confirmed just now)
            return time.monotonic()

        try:
            try:
                return await retry_without_deadline(
                    slot,
                    retry_on=(CoordinationUnavailableError, CoordinationBusyError),
                    wait=self.rt.redis_retry_wait,
                    on_retry=self._on_budget_unanswered,
                )
            except LeaseLostError as exc:
                metrics.LEASE_LOST.labels("submit").inc()
                log.info("submit lease lost while waiting for the rate budget: %s", exc)
                await lease.release()
                return None
        except BaseException:
            await lease.release()
            raise

    async def _running_slot(self, operation_id: str, model: str, lease: Lease) -> None:
        """Wait until ``operation_id`` holds a running-job slot of the account and of ``model``, renewing ``lease``
        every third of its TTL; a wait is logged once, counted in ``streams_running_slot_waits_total`` and its
        seconds in ``streams_running_slot_wait_seconds_total``.

        Raises:
            CoordinationUnavailableError, CoordinationBusyError: Redis did not answer, or the pool was full.
            LeaseLostError: the lease was lost while waiting.
        """
        answer = await self.rt.running.take(operation_id, model)
        if answer.granted:
            return
        started = time.monotonic()
        log.info(
            "no running-job slot (%d of the account's, %d of model %s's in use); waiting",
            answer.account_in_use,
            answer.model_in_use,
            model,
        )
        metrics.RUNNING_SLOT_WAITS.inc()
        sleeper = KeptAliveSleep(lease.renew, lease.ttl_ms / 3000)
        try:
            while not answer.granted:
                await sleeper.sleep(RUNNING_SLOT_RETRY_S * (1.0 + random.random()))
                answer = await self.rt.running.take(operation_id, model)
        finally:
            metrics.RUNNING_SLOT_WAIT_SECONDS.inc(time.monotonic() - started)

    def _on_budget_unanswered(self, exc: BaseException) -> None:
        if isinstance(exc, CoordinationUnavailableError):
            metrics.COORDINATION_UNAVAILABLE.labels("submit").inc()
        self.rt.report_failure("rate budget", exc)  # an outage, or this worker's pool full

    async def _post_slot_in_claim(self, holder: list[Lease], deadline: float) -> None:
        """Wait for a POST slot of the rate budget inside the claim, keeping the submit lease in ``holder[0]``
        renewed (re-taken if lost: the fencing value is ours), until ``deadline`` (``time.monotonic()``). A wait
        interrupted (lease lost, Redis unavailable, this worker's Redis pool full) is asked again after
        :meth:`Runtime.redis_retry_wait`, never past ``deadline``.

        Raises:
            RateBudgetDeadlineError: no slot before ``deadline``; nothing was sent.
        """

        async def slot() -> None:
            lease = holder[0]
            try:
                await self.rt.budget.wait_for_slot(
                    BudgetKind.POST, keep_alive=lease.renew, keep_alive_every_s=lease.ttl_ms / 3000, deadline=deadline
                )
            except (LeaseLostError, CoordinationUnavailableError, CoordinationBusyError) as exc:
                log.info("POST slot wait interrupted (%s); renewing or re-taking the submit lease", exc)
                holder[0] = await self._ensure_lease(lease)  # waits out Redis; re-takes a lost lease
                raise
            holder[0] = await self._ensure_lease(lease)

        def wait_s(retry_state: tenacity.RetryCallState) -> float:
            return min(self.rt.redis_retry_wait(retry_state), max(0.0, deadline - time.monotonic()))

        await retry_without_deadline(
            slot, retry_on=(LeaseLostError, CoordinationUnavailableError, CoordinationBusyError), wait=wait_s
        )

    async def _ensure_lease(self, lease: Lease) -> Lease:
        """Renew the submit lease before a send (unless confirmed recently enough: :meth:`Lease.renew_if_due`;
        again after ``lease_busy_retry_s`` while this worker's Redis pool is full); re-take it if it expired or
        Redis did not answer (we still hold the fencing value)."""
        try:
            await retry_without_deadline(
                lease.renew_if_due,
                retry_on=CoordinationBusyError,
                wait=self._lease_busy_wait(),
                on_retry=lambda exc: log.info("submit lease not renewed yet: %s", exc),
            )
            return lease
        except LeaseLostError as exc:
            metrics.LEASE_LOST.labels("submit").inc()
            log.info("submit lease lost before a send, taking it again: %s", exc)
        except CoordinationUnavailableError as exc:
            metrics.COORDINATION_UNAVAILABLE.labels("submit").inc()
            self.rt.log_outage("Redis", exc)

        async def take_again() -> Lease:
            new = await self.rt.acquire_waiting(lease.key, "submit")  # waits out Redis
            if new is None:
                raise _LeaseHeld(lease.key)
            return new

        return await retry_without_deadline(take_again, retry_on=_LeaseHeld, wait=self._lease_busy_wait())

    def _lease_busy_wait(self) -> tenacity.wait.wait_base:
        """The wait before taking or renewing a lease again that another holder has, or this worker's full Redis
        pool could not renew: ``lease_busy_retry_s``."""
        return tenacity.wait_fixed(self.rt.settings.lease_busy_retry_s)

    async def _submit(
        self, operation_id: str, request_text: str, fencing: int, lease: Lease, slot_at: float | None = None
    ) -> None:
        """POST (with the allowed retries) and save the outcome; releases the submit lease when done.

        ``slot_at``: ``time.monotonic()`` of a POST slot of the rate budget granted before the claim (None: none;
        one is then waited for inside the claim, within the retry deadline).
        """
        posted: list[RemoteCall] = []  # the POST that reported a job, until its accounting record is written
        try:
            await self._submit_and_save(operation_id, request_text, fencing, lease, slot_at, posted)
        finally:
            if posted:  # no save carried it (refused as a value, or cut off before it): recorded by itself
                await self.rt.ledger.record_remote_call(posted[0])

    async def _submit_and_save(
        self,
        operation_id: str,
        request_text: str,
        fencing: int,
        lease: Lease,
        slot_at: float | None,
        posted: list[RemoteCall],
    ) -> None:
        """:meth:`_submit`'s work; the POST that reported a job is put in ``posted`` and taken out once the job-id
        save that carries its accounting record completed (written or refused)."""
        settings = self.rt.settings
        holder = [lease]
        deadline = time.monotonic() + settings.submit_retry_deadline_s
        attempts = 0

        async def post() -> SubmitResult:
            nonlocal attempts, slot_at
            attempts += 1
            if attempts > 1 and not await self._still_ours(operation_id, fencing):
                raise _NoLongerOurs()
            holder[0] = await self._ensure_lease(holder[0])
            if slot_at is None or time.monotonic() - slot_at > SLOT_VALID_S:
                if slot_at is not None:
                    age_s = time.monotonic() - slot_at
                    log.info("POST slot %.3f s old, waiting for another", age_s)
                await self._post_slot_in_claim(holder, deadline)
            slot_at = None
            result, call = await self._post_once(operation_id, request_text, fencing)
            posted.append(call)
            return result

        def retrying() -> tenacity.AsyncRetrying:  # built only once a first POST was refused or not sent
            return tenacity.AsyncRetrying(
                retry=tenacity.retry_if_exception_type(_RETRIED),
                wait=_wait_for_retry(tenacity.wait_exponential_jitter(multiplier=0.2, max=5.0), deadline),
                stop=_stop_at(deadline),
                reraise=True,
            )

        try:
            result = await first_attempt_plain(post, retrying, _RETRIED)
        except _NoLongerOurs:
            log.warning("left submitting while a retry waited; not sending again")
            return
        except RateBudgetDeadlineError as exc:
            why = f"never sent within {settings.submit_retry_deadline_s:.0f} s (nothing created): {exc}"
            await self._finish_without_job(operation_id, fencing, OperationState.REJECTED, why, ReasonCode.NOT_SENT)
            return
        except RemoteRefusedError as exc:  # includes 429 past the deadline: nothing was created
            code = ReasonCode.RATE_LIMITED if isinstance(exc, RemoteRateLimitedError) else ReasonCode.REFUSED
            await self._finish_without_job(operation_id, fencing, OperationState.REJECTED, str(exc), code)
            return
        except RemoteNotSentError as exc:
            why = f"never sent within {settings.submit_retry_deadline_s:.0f} s (nothing created): {exc}"
            await self._finish_without_job(operation_id, fencing, OperationState.REJECTED, why, ReasonCode.NOT_SENT)
            return
        except RemoteUnknownOutcomeError as exc:
            code = ReasonCode.UNKNOWN_OUTCOME
            await self._finish_without_job(operation_id, fencing, OperationState.UNCERTAIN, str(exc), code)
            return
        finally:
            await holder[0].release()
        logs.bind(remote_job_id=result.job_id)
        reason = f"job id from HTTP {result.status_code} error.job_id" if result.via_error else None
        first_poll_s = result.poll_after_s if result.poll_after_s is not None else settings.poll_backoff_base_s
        saving_at = time.monotonic()  # the ledger's first poll is due first_poll_s after its statement started
        first_polls = self.first_polls
        in_process = first_polls is not None and first_polls.reserve(first_poll_s)
        saved: bool | FirstPollClaim = False
        try:
            saved = await self.rt.ledger.save_submitted(
                operation_id,
                fencing,
                result.job_id,
                # claimed here: due for another worker only if this one never takes it (firstpoll.py)
                first_poll_s + settings.visibility_timeout_s if in_process else first_poll_s,
                reason,
                call=posted[0],
                first_poll_claim_id=uuid.uuid4() if in_process else None,
            )
            posted.clear()  # its accounting record written by the save
        except LedgerDataError as exc:  # e.g. the API returned a job id another operation already holds
            log.error("job %s created but its id cannot be saved: %s", result.job_id, exc)
            await self.rt.ledger.record_remote_call(posted.pop())  # the save wrote nothing: recorded by itself
            why = f"remote job {result.job_id} was created but its id could not be saved ({exc}); reconcile by hand"
            code = ReasonCode.JOB_ID_NOT_SAVED
            await self._finish_without_job(operation_id, fencing, OperationState.UNCERTAIN, why, code)
            return
        finally:
            if first_polls is not None and in_process and not isinstance(saved, FirstPollClaim):
                first_polls.unreserve()
        if isinstance(saved, FirstPollClaim):
            assert first_polls is not None  # only a reservation asks for the claim
            metrics.SUBMISSIONS.labels("submitted").inc()
            first_polls.start(operation_id, saved, saving_at + first_poll_s)
        elif saved:
            metrics.SUBMISSIONS.labels("submitted").inc()
            # its first poll, to this worker's scheduler: due when the ledger's is, not a save's duration later (now,
            # when the save asked for the first poll and a recorded cancellation made it due at once instead)
            self.rt.wakeups.polls.due_in((0.0 if in_process else first_poll_s) - (time.monotonic() - saving_at))
        else:
            metrics.FENCING_REFUSALS.labels("submit").inc()
            await self._record_late_job(operation_id, result.job_id, fencing)

    async def _record_late_job(self, operation_id: str, job_id: str, fencing: int) -> None:
        """The POST's job could not be saved (fencing value ``fencing`` refused): when the operation was decided
        meanwhile (abandoned, or adopted with another job), account the job as created after the decision, count
        it and say what to do (docs/decisions.md); otherwise (still uncertain, a lookup's newer claim) leave it to
        the reconciler or an operator, as recorded in remote_calls and remote_jobs."""
        state = await self.rt.ledger.record_late_job(operation_id, job_id)
        if state is None:
            log.error(
                "job id %s NOT saved: fencing value %s refused (the operation was claimed again or "
                "reconciled meanwhile); the job is recorded in remote_calls for reconciliation",
                job_id,
                fencing,
            )
            return
        metrics.JOBS_CREATED_AFTER_DECISION.labels(state).inc()
        action = (
            f"adopt it (streams operations adopt {operation_id} {job_id} --reason ...) or cancel it at the provider"
            if state == OperationState.REJECTED
            else "cancel it at the provider (the operation observes another job)"
        )
        log.error(
            "job %s was created after the operation was decided (%s; fencing value %s refused): it is "
            "not observed and may be charged; recorded as created_after_decision in the accounting: %s "
            "(docs/decisions.md)",
            job_id,
            state,
            fencing,
            action,
        )

    async def _still_ours(self, operation_id: str, fencing: int) -> bool:
        row = await self.rt.ledger.get_operation(operation_id)
        return row is not None and row["state"] == OperationState.SUBMITTING and row["fencing_token"] == fencing

    async def _post_once(self, operation_id: str, request_text: str, fencing: int) -> tuple[SubmitResult, RemoteCall]:
        """One POST: a failure is accounted (metrics and ledger) and raised; a job reported comes back with its
        call, counted in the metrics, whose ledger record the caller writes (with the job-id save)."""
        started = time.perf_counter()
        try:
            result = await self.rt.remote.submit(operation_id, request_text)
        except RemoteError as exc:
            await self.rt.account_failure(operation_id, "POST", exc, started, None, fencing)
            if isinstance(exc, RemoteRateLimitedError):
                await self.rt.budget.note_rate_limited(BudgetKind.POST, exc.retry_after_s)
            if not isinstance(exc, RemoteRateLimitedError | RemoteNotSentError):
                log.warning("POST %s: %s", exc.outcome, exc)
            raise
        outcome = RemoteCallOutcome.CREATED_VIA_502 if result.via_error else RemoteCallOutcome.CREATED
        call = RemoteCall(operation_id, "POST", result.status_code, outcome, result.job_id, result.duration_ms, fencing)
        self.rt.count_call(call)
        return result, call

    async def _finish_without_job(
        self, operation_id: str, fencing: int, state: OperationState, reason: str, code: ReasonCode
    ) -> None:
        saved = await self.rt.ledger.save_submission_without_job(operation_id, fencing, state, reason, code)
        if state is OperationState.REJECTED:  # nothing was created: its running-job slot is free again
            await self.rt.running.release(operation_id)
        if saved:
            metrics.SUBMISSIONS.labels(state.value).inc()
        else:
            metrics.FENCING_REFUSALS.labels("submit").inc()
            log.warning("%s not saved: fencing value %s refused", state, fencing)
