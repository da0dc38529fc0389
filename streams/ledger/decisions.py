"""Operators' decisions on the ledger: adopt, abandon, repoll and fail, each one fenced transition."""

from __future__ import annotations

from collections.abc import Awaitable

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


    async def adopt(self, operation_id: str, remote_job_id: str, reason: str, actor: str) -> OperatorMove:
        """An operator adopts the job found at the provider for an ``uncertain`` operation: ``uncertain ->
        submitted`` with that job id, observed from now on; the job gets an accounting record ``adopted``.

        Args:
            operation_id: the operation.
            remote_job_id: the provider's job id (``[A-Za-z0-9][A-Za-z0-9._:-]{0,255}``).
            reason: why (recorded in the transition log), non-empty.
            actor: who decided (recorded as the transition's worker), non-empty.

        Raises:
            UnknownOperationError: the ledger does not hold the operation.
            OperatorActionRefusedError: the operation is not ``uncertain``, the job id is malformed or already
                saved for another operation, or reason/actor is empty. Nothing is written.
        """
        action = "adopt"
        if not JOB_ID.fullmatch(remote_job_id):
            raise OperatorActionRefusedError(
                operation_id, action, f"{clean_text(repr(remote_job_id), 80)} is not a usable remote job id"
            )
        why = self._decision_text(operation_id, action, reason, actor, f"adopted job {remote_job_id}")
        try:
            return await self._decide(
                action,
                operation_id,
                OperationState.UNCERTAIN,
                OperationState.SUBMITTED,
                OPS.adopt.fetchrow(
                    self.pool, operation_id=operation_id, remote_job_id=remote_job_id, reason=why, actor=actor
                ),
            )
        except LedgerDataError:
            async with guard(f"read holder of job {remote_job_id}"):
                holder = await OPS.operation_holding_job.fetchval(self.pool, remote_job_id=remote_job_id)
            if holder is not None and holder != operation_id:
                raise OperatorActionRefusedError(
                    operation_id,
                    action,
                    f"remote job {remote_job_id} is already saved for operation {holder!r}; a job belongs to one "
                    "operation",
                    state=OperationState.UNCERTAIN.value,
                ) from None
            raise

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
