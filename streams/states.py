"""Operation states and the rules for moving between them.

The PostgreSQL enum ``operation_state`` mirrors :class:`OperationState` (a migration test checks it) and a
trigger in the ledger refuses any transition that :func:`can_transition` refuses.

Who moves work out of each state:

============== ==============================================================================
accepted       dispatcher: claims it (``submitting``, written *before* the POST)
submitting     dispatcher: saves the POST outcome (``submitted``/``rejected``/``uncertain``);
               reconciler (poll scheduler): a stale ``submitting`` with no outcome -> ``uncertain``
submitted      observer: saves GET snapshots (``queued``/``running``/terminal)
queued         observer
running        observer
uncertain      dispatcher, only when the same POST's answer arrives late with a job id
               (-> ``submitted``); otherwise an operator decision. Never resubmitted automatically.
succeeded      nobody (terminal)
failed         nobody (terminal)
canceled       nobody (terminal)
rejected       nobody (terminal: the API refused definitely, nothing was created)
============== ==============================================================================
"""

from __future__ import annotations

import enum


class OperationState(enum.StrEnum):
    """Lifecycle state of one generation operation."""

    ACCEPTED = "accepted"
    SUBMITTING = "submitting"
    SUBMITTED = "submitted"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    UNCERTAIN = "uncertain"
    REJECTED = "rejected"


S = OperationState

TERMINAL: frozenset[OperationState] = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELED, S.REJECTED})

#: Remote job statuses (the API's words) and the state each one maps to.
REMOTE_STATUS_TO_STATE: dict[str, OperationState] = {
    "queued": S.QUEUED,
    "pending": S.QUEUED,
    "running": S.RUNNING,
    "in_progress": S.RUNNING,
    "succeeded": S.SUCCEEDED,
    "completed": S.SUCCEEDED,
    "failed": S.FAILED,
    "canceled": S.CANCELED,
    "cancelled": S.CANCELED,
}

_ALLOWED: dict[OperationState, frozenset[OperationState]] = {
    S.ACCEPTED: frozenset({S.SUBMITTING}),
    S.SUBMITTING: frozenset({S.SUBMITTED, S.REJECTED, S.UNCERTAIN}),
    S.UNCERTAIN: frozenset({S.SUBMITTED}),
    S.SUBMITTED: frozenset({S.QUEUED, S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELED}),
    S.QUEUED: frozenset({S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELED}),
}


def can_transition(current: OperationState, new: OperationState) -> bool:
    """True when ``current -> new`` is a legal forward move.

    Terminal states never change; a late ``running`` can never replace ``succeeded``; staying in the same
    state is not a transition (returns False).
    """
    return new in _ALLOWED.get(current, frozenset())


def is_terminal(state: OperationState) -> bool:
    """True for ``succeeded``, ``failed``, ``canceled`` and ``rejected``."""
    return state in TERMINAL


def state_for_remote_status(status: str) -> OperationState | None:
    """The operation state for a remote job ``status`` string, or None when the status is unknown."""
    return REMOTE_STATUS_TO_STATE.get(status.strip().lower())
