"""The reconciler: ``uncertain`` operations looked up at the provider by the client reference their POST carried.

Runs in the poll scheduler's timer when ``lookup_enabled`` is set (off by default: the provider must offer a
lookup by client reference, declared as the dialect's ``lookup``, docs/provider-dialects.md). It never POSTs.

Without a lookup (``lookup_enabled`` off, or a dialect whose declaration says ``"lookup": null``, e.g.
``replicate-predictions``, where turning it on is refused when the worker starts): nothing looks an ``uncertain``
operation up. It stays ``uncertain``, is never POSTed again, and a cancellation recorded for it waits; an operator
adopts the job found in the provider's console (``streams operations adopt OP JOB``) or abandons it
(docs/decisions.md). A late POST answer with its job id still makes it ``submitted``.

For each claimed operation (claimed in PostgreSQL, fenced like an observation; first claim ``lookup_lag_s`` after
the operation became uncertain, the provider's consistency lag):

* one job found: adopted, ``uncertain -> submitted``, then observed as usual (accounting record ``lookup``);
* several found: the first by creation time is adopted; the others are recorded as duplicate creations in the
  accounting (the provider created them and may charge for them: nobody may hide them);
* none found: the operation stays ``uncertain``, left for a person with the reason "not found by lookup";
* the lookup failed: tried again later with capped backoff (after ``Retry-After`` on 429, which also pauses
  every worker's GETs).

A lookup is a GET of the provider account: it waits for a slot of the account's GET budget
(:mod:`streams.coordination.ratebudget`) first; no slot within half the visibility timeout, or Redis unavailable: no
lookup,
tried again later.

The client reference is not an idempotency key: nothing here assumes the provider created at most one job. Jobs
created well before the operation was accepted are left out: they belong to a former operation of the same id
(``streams purge --ids-older-than`` frees ids), never to this one, whose POST came after its acceptance.
"""

from __future__ import annotations

import asyncio
import logging
import time

from streams import logs, metrics
from streams.backoff import next_poll_delay_s
from streams.coordination.ratebudget import BudgetKind
from streams.errors import (
    CoordinationBusyError,
    CoordinationUnavailableError,
    LedgerUnavailableError,
    RateBudgetDeadlineError,
    RemoteError,
    RemoteRateLimitedError,
    RemoteRefusedError,
)
from streams.ledger.records import FORMER_JOB_MARGIN_S, LookupClaim, RemoteCall
from streams.model.answers import LookupJob
from streams.model.codes import RemoteCallOutcome
from streams.worker.runtime import Runtime

log = logging.getLogger(__name__)


class Reconciler:
    """Looks up claimed ``uncertain`` operations and adopts, records or leaves them (see module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def tick(self) -> int:
        """One round: claim due lookups and handle them concurrently. Returns the number claimed (0 when
        ``lookup_enabled`` is off, or when PostgreSQL did not answer the claim: the next round retries; claims
        taken come back by themselves)."""
        s = self.rt.settings
        if not s.lookup_enabled:
            return 0
        try:
            claims = await self.rt.ledger.claim_due_lookups(s.poll_batch_size, s.lookup_lag_s, s.visibility_timeout_s)
        except LedgerUnavailableError as exc:
            self.rt.log_outage("PostgreSQL", exc)
            return 0
        if claims:
            await asyncio.gather(*(self.reconcile(c) for c in claims))
        return len(claims)

    async def reconcile(self, claim: LookupClaim) -> None:
        """Look one claimed operation up and save the result, fenced (see module docstring)."""
        rt = self.rt
        op = claim.operation_id
        logs.bind(operation_id=op, fencing_token=claim.fencing_token)  # this task's lines (gather gives each its own)
        try:
            deadline = time.monotonic() + rt.settings.visibility_timeout_s / 2  # well before the claim comes back
            await rt.budget.wait_for_slot(BudgetKind.GET, deadline=deadline)
        except (CoordinationUnavailableError, CoordinationBusyError, RateBudgetDeadlineError) as exc:
            log.info("no lookup now (%s)", exc)
            await rt.ledger.reschedule_lookup(claim, self._delay(claim))
            return
        started = time.perf_counter()
        try:
            found = await rt.remote.lookup(op)
        except RemoteError as exc:
            outcome = RemoteCallOutcome.of_lookup(exc.outcome)
            await rt.account_failure(op, "GET", exc, started, None, claim.fencing_token, outcome)
            metrics.LOOKUPS.labels("failed").inc()
            if isinstance(exc, RemoteRateLimitedError):
                delay = exc.retry_after_s
                await rt.budget.note_rate_limited(BudgetKind.GET, delay)
            else:
                delay = self._delay(claim)
                if isinstance(exc, RemoteRefusedError):  # not an outage: waiting cannot fix it, say so loudly
                    rt.report_failure("lookup by client reference", exc)
                else:
                    log.info("lookup failed, retrying in %.1f s: %s", delay, exc)
            await rt.ledger.reschedule_lookup(claim, delay)
            return
        duration_ms = (time.perf_counter() - started) * 1000.0
        found = _not_former(claim, found)
        outcome = RemoteCallOutcome.lookup_found(len(found))
        await rt.account(RemoteCall(op, "GET", 200, outcome, None, duration_ms, claim.fencing_token))
        if not found:
            reason = (
                f"not found by lookup; looked up {claim.uncertain_for_s:.0f} s after the outcome became unknown "
                f"(provider's consistency lag {rt.settings.lookup_lag_s:.0f} s): check at the provider, then adopt "
                "or abandon"
            )
            if await rt.ledger.give_up_lookup(claim, reason):
                metrics.LOOKUPS.labels("not_found").inc()
                log.warning("%s", reason)
            else:
                metrics.FENCING_REFUSALS.labels("reconcile").inc()
            return
        adopted, duplicates = found[0], found[1:]
        logs.bind(remote_job_id=adopted.job_id)
        reason = f"adopted job {adopted.job_id} found by lookup of the client reference"
        if duplicates:
            reason += f"; {len(duplicates)} further job(s) recorded as duplicate creations: " + ", ".join(
                j.job_id for j in duplicates[:10]
            )
        first_poll_s = rt.settings.poll_backoff_base_s
        saved = await rt.ledger.adopt_found_job(claim, found, reason, first_poll_s)
        metrics.DUPLICATE_CREATIONS.inc(len(duplicates))
        if saved:
            metrics.LOOKUPS.labels("adopted").inc()
            log.warning("%s", reason)
        else:
            metrics.FENCING_REFUSALS.labels("reconcile").inc()
            log.warning(
                "found job(s) %s recorded, but not adopted: a newer claim or an operator decided",
                [j.job_id for j in found],
            )

    def _delay(self, claim: LookupClaim) -> float:
        """Capped exponential backoff by the number of lookups so far (at least 1 s)."""
        s = self.rt.settings
        return next_poll_delay_s(
            claim.lookup_count - 1, None, base_s=s.poll_backoff_base_s, cap_s=s.poll_backoff_cap_s, min_s=1.0
        )


def _not_former(claim: LookupClaim, found: list[LookupJob]) -> list[LookupJob]:
    """``found`` without the jobs of a former operation of the same id (``streams purge --ids-older-than`` freed it;
    they carry the same client reference): those the accounting learned for the id before this operation was accepted
    (``former_job_ids``), those created more than :data:`FORMER_JOB_MARGIN_S` before it was accepted (never this
    operation's, whose POST came after its acceptance), and, when the id had a former operation (jobs or calls of it
    in the accounting from before), those without a creation time (left for a person: nothing tells them apart). Each
    one left out is logged."""
    before_ms = None if claim.accepted_at_ms is None else claim.accepted_at_ms - FORMER_JOB_MARGIN_S * 1000
    former = [
        j
        for j in found
        if j.job_id in claim.former_job_ids
        or (before_ms is not None and j.created_at_ms is not None and j.created_at_ms < before_ms)
        or ((claim.former_job_ids or claim.had_former) and j.created_at_ms is None)  # nothing tells them apart
    ]
    if former:
        log.warning(
            "lookup: %d job(s) of a former operation of this id left out (learned or created before it was "
            "accepted): %s",
            len(former),
            ", ".join(j.job_id for j in former[:10]),
        )
    return [j for j in found if j not in former]
