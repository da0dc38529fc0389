"""The accounting of remote jobs on the ledger: refunds learned apart from an observation, and the summary."""

from __future__ import annotations

from typing import Any

import asyncpg

from streams.ledger.pool import guard
from streams.ledger.sql import ACCOUNTING


class Accounting:
    """The accounting reads and writes, mixed into :class:`streams.ledger.store.Ledger` (its ``pool``)."""

    pool: asyncpg.Pool

    async def record_refund(self, remote_job_id: str, refund: dict[str, Any]) -> bool:
        """Record a refund the provider reported for a job, once per (refund id, job id); ``refund`` is the
        provider's object (a string ``id``; ``amount`` and ``currency`` as sent). A terminal observation records
        its refund by itself; this is for refunds learned otherwise. Never used to decide whether a job was
        created.

        Returns True when recorded now, False when it already was (or the job has no accounting record, or the
        refund carries no string id).
        """
        async with guard(f"record refund for job {remote_job_id}"):
            row = await ACCOUNTING.record_refund.fetchval(self.pool, remote_job_id=remote_job_id, refund=refund)
        return row is not None

    async def accounting_summary(self, operation_pattern: str = "%") -> dict[str, Any]:
        """The accounting summary of the operations whose id matches ``operation_pattern`` (SQL ``LIKE``).

        Returns a dict: ``jobs_by_outcome`` ({outcome or ``not_terminal``: n}), ``jobs_by_learned_via``
        ({``post_2xx``/``post_502``/``adopted``/``lookup``/``duplicate``/
        ``created_after_decision``: n}), ``learned_only_via_502``,
        ``duplicate_creations``, ``charges`` ([{currency, amount (decimal text), jobs}]), ``refunds_settled``
        ([{currency, amount, refunds}]), ``refunds_pending`` (failed/canceled jobs with a charge and no refund
        recorded), ``needs_decision`` ({``uncertain``/``stalled``: {operations, oldest_age_s}}),
        ``posts_per_operation`` and ``gets_per_completed_operation`` ({operations, mean, max}),
        ``created_after_decision`` ({``jobs``, ``unobserved``, ``first``: [{operation_id, remote_job_id, state}],
        the unobserved, oldest first, at most 20}: jobs a POST answer reported after an operator's decision).
        """
        async with guard("accounting summary"):
            row = await ACCOUNTING.accounting_summary.fetchrow(self.pool, operation_pattern=operation_pattern)
        assert row is not None  # aggregates only: always one row
        return dict(row)
