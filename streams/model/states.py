"""Operation states and the rules for moving between them.

The PostgreSQL enum ``operation_state`` mirrors :class:`OperationState` and the table
``operation_state_transitions`` mirrors :func:`can_transition` (a migration test checks both); a trigger in the
ledger refuses any transition the table does not hold.

Who moves work out of each state:

============== ==============================================================================
accepted       dispatcher: claims it (``submitting``, written *before* the POST); the scheduler's re-dispatch
               when it is left there past ``accepted_stale_after_s`` (same lease, same fenced claim); a
               cancellation recorded before the claim: ``canceled`` (by the cancel itself, or by the claim that
               finds it), and no POST is ever sent (docs/cancellation.md)
submitting     dispatcher: saves the POST outcome (``submitted``/``rejected``/``uncertain``);
               reconciler (poll scheduler): a stale ``submitting`` with no outcome -> ``uncertain``
submitted      observer: saves GET snapshots (``queued``/``running``/terminal), or ``stalled`` when the
               provider's answers stop making progress (404 past the grace window, an unknown status
               ``unknown_status_limit`` times in a row, observed longer than ``max_observation_age_s``)
queued         observer (as ``submitted``)
running        observer (as ``submitted``)
uncertain      reconciler, when lookup by client reference is on: adopts the job found (-> ``submitted``),
               or leaves it for a person ("not found by lookup"); the dispatcher, when the same POST's
               answer arrives late with a job id (-> ``submitted``); an operator: ``adopt`` a job id found at
               the provider (-> ``submitted``) or ``abandon`` it as not created (-> ``rejected``).
               Never resubmitted automatically.
stalled        an operator: ``repoll`` (-> ``submitted``, observed again) or ``fail`` (-> ``failed``).
               Nothing polls it meanwhile.
succeeded      nobody (terminal)
failed         nobody (terminal)
canceled       nobody (terminal; never has outputs: only ``succeeded`` saves them)
rejected       nobody (terminal: the API refused definitely, or an operator checked that nothing was created),
               with one exception: an operator ``adopt`` of the job a POST answer reported *after* the decision
               (``remote_jobs.learned_via = 'created_after_decision'``) -> ``submitted``; the trigger
               ``operations_late_job_guard`` (migration 0010) refuses the move for any other job
               (docs/decisions.md).
============== ==============================================================================

A state may be entered more than once (``stalled -> submitted -> stalled``): the transition log numbers each
operation's transitions, and the event id ``transition:<operation id>:<seq>:<state>`` stays deterministic.
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
    STALLED = "stalled"


S = OperationState

TERMINAL: frozenset[OperationState] = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELED, S.REJECTED})

#: States whose remote job is observed by polling.
POLLABLE: frozenset[OperationState] = frozenset({S.SUBMITTED, S.QUEUED, S.RUNNING})

#: States in which the pipeline stops and waits for the reconciler or a person.
NEEDS_DECISION: frozenset[OperationState] = frozenset({S.UNCERTAIN, S.STALLED})

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
    S.ACCEPTED: frozenset({S.SUBMITTING, S.CANCELED}),
    S.SUBMITTING: frozenset({S.SUBMITTED, S.REJECTED, S.UNCERTAIN}),
    S.UNCERTAIN: frozenset({S.SUBMITTED, S.REJECTED}),
    S.SUBMITTED: frozenset({S.QUEUED, S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELED, S.STALLED}),
    S.QUEUED: frozenset({S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELED, S.STALLED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELED, S.STALLED}),
    S.STALLED: frozenset({S.SUBMITTED, S.FAILED}),
    S.REJECTED: frozenset({S.SUBMITTED}),
}

#: Legal moves allowed only under a condition the ledger's trigger checks, and that condition.
CONDITIONAL: dict[tuple[OperationState, OperationState], str] = {
    (S.REJECTED, S.SUBMITTED): "an operator adopts the job created after the decision (migration 0010)",
}


def can_transition(current: OperationState, new: OperationState) -> bool:
    """True when ``current -> new`` is a legal move.

    Moves go forward, except an operator's ``stalled -> submitted`` (observe again) and ``rejected -> submitted``
    (adopt the job created after the decision: :data:`CONDITIONAL`). Other terminal states never change; a late
    ``running`` can never replace ``succeeded``, nor ``queued`` a saved ``running``; staying in the same state is
    not a transition (returns False).
    """
    return new in _ALLOWED.get(current, frozenset())


def is_terminal(state: OperationState) -> bool:
    """True for ``succeeded``, ``failed``, ``canceled`` and ``rejected``."""
    return state in TERMINAL


def state_for_remote_status(status: str) -> OperationState | None:
    """The operation state for a remote job ``status`` string, or None when the status is unknown."""
    return REMOTE_STATUS_TO_STATE.get(status.strip().lower())
