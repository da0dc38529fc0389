"""Operators' decisions on the ledger: adopt, abandon, repoll and fail, each one fenced transition (what each
undoes and what corrects it: docs/decisions.md)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import asyncpg

from streams.errors import LedgerDataError, OperatorActionRefusedError, UnknownOperationError
from streams.ledger.pool import guard
from streams.ledger.records import OperatorMove
from streams.ledger.sql import LEDGER as Q
from streams.ledger.sql import OPERATORS as OPS
from streams.model.answers import JOB_ID, clean_text
from streams.model.states import OperationState


class Decisions:
    """The operators' decisions, mixed into :class:`streams.ledger.store.Ledger` (its ``pool``)."""

    pool: asyncpg.Pool

    async def adopt(
        self,
        operation_id: str,
        remote_job_id: str,
        reason: str,
        actor: str,
        provider_check: Callable[[], Awaitable[str]] | None = None,
    ) -> OperatorMove:
        """An operator adopts a job found at the provider: ``uncertain -> submitted`` with that job id, observed
        from now on, the job accounted ``adopted``; or, for a ``rejected`` operation whose POST answer arrived
        after the decision, ``rejected -> submitted`` with exactly that job (accounted ``created_after_decision``;
        the ledger's trigger refuses any other job).

        Args:
            operation_id: the operation.
            remote_job_id: the provider's job id (``[A-Za-z0-9][A-Za-z0-9._:-]{0,255}``).
            reason: why (recorded in the transition log), non-empty.
            actor: who decided (recorded as the transition's worker), non-empty.
            provider_check: awaited once the operation is found adoptable, before anything is written; returns
                the words recorded in the reason (what the provider answered for the job), or raises
                :class:`OperatorActionRefusedError` (the provider does not know the job, or could not be asked).

        Raises:
            UnknownOperationError: the ledger does not hold the operation.
            OperatorActionRefusedError: the operation is neither ``uncertain`` nor ``rejected`` with this job
                created after the decision, the job id is malformed or already saved for another operation,
                reason/actor is empty, or ``provider_check`` refused. Nothing is written.
        """
        action = "adopt"
        if not JOB_ID.fullmatch(remote_job_id):
            raise OperatorActionRefusedError(
                operation_id, action, f"{clean_text(repr(remote_job_id), 80)} is not a usable remote job id"
            )
        self._decision_text(operation_id, action, reason, actor, "")  # refuse an empty actor or reason first
        async with guard(f"read {operation_id}"):
            current = await Q.get_operation.fetchrow(self.pool, operation_id=operation_id)
            late = await OPS.late_jobs_of_operation.fetch(self.pool, operation_id=operation_id)
        if current is None:
            raise UnknownOperationError(operation_id)
        late_jobs = [row["remote_job_id"] for row in late]
        state = OperationState(current["state"])
        if state is OperationState.REJECTED and remote_job_id in late_jobs:
            from_state = OperationState.REJECTED
            what = f"adopted job {remote_job_id} created after the decision"
        elif state is OperationState.UNCERTAIN:
            from_state = OperationState.UNCERTAIN
            what = f"adopted job {remote_job_id}"
        else:
            exception = (
                f" (or to this rejected one with the job created after its decision: {', '.join(late_jobs)})"
                if state is OperationState.REJECTED and late_jobs
                else ""
            )
            raise OperatorActionRefusedError(
                operation_id,
                action,
                f"it is {state.value}; adopt applies only to uncertain operations{exception}",
                state=state.value,
            )
        async with guard(f"read the accounting of job {remote_job_id}"):
            former = await OPS.former_job_of_operation.fetchval(
                self.pool, operation_id=operation_id, remote_job_id=remote_job_id
            )
        if former is not None:
            raise OperatorActionRefusedError(
                operation_id,
                action,
                f"job {remote_job_id} belongs to a former operation of this id (the accounting learned it before "
                "this operation was accepted; streams purge --ids-older-than freed the id): its outputs answer "
                "another request",
                state=state.value,
            )
        if provider_check is not None:
            async with guard(f"read holder of job {remote_job_id}"):
                holder = await OPS.operation_holding_job.fetchval(self.pool, remote_job_id=remote_job_id)
            if holder is not None and holder != operation_id:  # refused before asking the provider
                raise self._held_elsewhere(operation_id, remote_job_id, holder, from_state)
            what = f"{what}, {await provider_check()}"
        why = self._decision_text(operation_id, action, reason, actor, what)
        try:
            return await self._decide(
                action,
                operation_id,
                from_state,
                OperationState.SUBMITTED,
                OPS.adopt_late_job.fetchrow(
                    self.pool, operation_id=operation_id, remote_job_id=remote_job_id, reason=why, actor=actor
                )
                if from_state is OperationState.REJECTED
                else OPS.adopt.fetchrow(
                    self.pool, operation_id=operation_id, remote_job_id=remote_job_id, reason=why, actor=actor
                ),
            )
        except LedgerDataError:
            async with guard(f"read holder of job {remote_job_id}"):
                holder = await OPS.operation_holding_job.fetchval(self.pool, remote_job_id=remote_job_id)
            if holder is not None and holder != operation_id:
                raise self._held_elsewhere(operation_id, remote_job_id, holder, from_state) from None
            raise

    @staticmethod
    def _held_elsewhere(
        operation_id: str, remote_job_id: str, holder: str, state: OperationState
    ) -> OperatorActionRefusedError:
        return OperatorActionRefusedError(
            operation_id,
            "adopt",
            f"remote job {remote_job_id} is already saved for operation {holder!r}; a job belongs to one operation",
            state=state.value,
        )

    async def abandon(self, operation_id: str, reason: str, actor: str) -> OperatorMove:
        """An operator checked that the provider created no job for an ``uncertain`` operation: ``uncertain ->
        rejected`` ("not created, checked by an operator").

        Raises:
            UnknownOperationError: the ledger does not hold the operation.
            OperatorActionRefusedError: the operation is not ``uncertain``, or reason/actor is empty.
        """
        action = "abandon"
        why = self._decision_text(operation_id, action, reason, actor, "not created, checked by an operator")
        return await self._decide(
            action,
            operation_id,
            OperationState.UNCERTAIN,
            OperationState.REJECTED,
            OPS.abandon.fetchrow(self.pool, operation_id=operation_id, reason=why, actor=actor),
        )

    async def repoll(self, operation_id: str, actor: str, reason: str = "observe again") -> OperatorMove:
        """An operator has a ``stalled`` operation observed again: ``stalled -> submitted``, due now, with a fresh
        observation window (maximum age and unknown-status count start over).

        Raises:
            UnknownOperationError: the ledger does not hold the operation.
            OperatorActionRefusedError: the operation is not ``stalled``, or actor is empty.
        """
        action = "repoll"
        why = self._decision_text(operation_id, action, reason, actor, "repolled by an operator")
        return await self._decide(
            action,
            operation_id,
            OperationState.STALLED,
            OperationState.SUBMITTED,
            OPS.repoll.fetchrow(self.pool, operation_id=operation_id, reason=why, actor=actor),
        )

    async def fail(self, operation_id: str, reason: str, actor: str) -> OperatorMove:
        """An operator ends a ``stalled`` operation: ``stalled -> failed`` with the reason.

        Raises:
            UnknownOperationError: the ledger does not hold the operation.
            OperatorActionRefusedError: the operation is not ``stalled``, or reason/actor is empty.
        """
        action = "fail"
        why = self._decision_text(operation_id, action, reason, actor, "failed by an operator")
        return await self._decide(
            action,
            operation_id,
            OperationState.STALLED,
            OperationState.FAILED,
            OPS.fail_stalled.fetchrow(self.pool, operation_id=operation_id, reason=why, actor=actor),
        )

    @staticmethod
    def _decision_text(operation_id: str, action: str, reason: str, actor: str, what: str) -> str:
        if not actor.strip():
            raise OperatorActionRefusedError(operation_id, action, "name who decides (actor)")
        if not reason.strip():
            raise OperatorActionRefusedError(operation_id, action, "give a reason; it is recorded")
        return clean_text(f"{what} ({actor.strip()}): {reason.strip()}")

    async def _decide(
        self,
        action: str,
        operation_id: str,
        from_state: OperationState,
        to_state: OperationState,
        decision: Awaitable[asyncpg.Record | None],
    ) -> OperatorMove:
        """Await ``decision`` (the decision's fenced statement, one row or none); when it wrote nothing, read the
        operation to say why."""
        async with guard(f"{action} {operation_id}"):
            row = await decision
            if row is not None:
                return OperatorMove(
                    operation_id, action, from_state, to_state, row["transition_seq"], row["fencing_token"]
                )
            current = await Q.get_operation.fetchrow(self.pool, operation_id=operation_id)
        if current is None:
            raise UnknownOperationError(operation_id)
        raise OperatorActionRefusedError(
            operation_id,
            action,
            f"it is {current['state']}; {action} applies only to {from_state.value} operations",
            state=current["state"],
        )
