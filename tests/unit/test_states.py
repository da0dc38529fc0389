"""Operation state rules, checked pair by pair against an explicit table."""

from __future__ import annotations

import itertools

import pytest

from streams.model.states import CONDITIONAL, OperationState, can_transition, is_terminal, state_for_remote_status

S = OperationState

# Written from the design's rules (README.md, "How it keeps its promises"), not from streams/model/states.py:
# accepted -> submitting -> submitted -> queued -> running -> succeeded | failed | canceled (forward, skipping
# intermediate observation states is allowed because a job may finish between two polls);
# submitting -> rejected | uncertain; uncertain -> submitted (a job found: adopted) | rejected (an operator
# checked nothing was created); a pollable job whose answers stop making progress -> stalled, left only by an
# operator: -> submitted (observe again) | failed; terminal states never change, but for an operator's adoption of
# the job a POST answer reported after an abandon (rejected -> submitted, conditional: docs/decisions.md).
LEGAL: frozenset[tuple[OperationState, OperationState]] = frozenset(
    {
        (S.ACCEPTED, S.SUBMITTING),
        (S.SUBMITTING, S.SUBMITTED),
        (S.SUBMITTING, S.REJECTED),
        (S.SUBMITTING, S.UNCERTAIN),
        (S.UNCERTAIN, S.SUBMITTED),
        (S.SUBMITTED, S.QUEUED),
        (S.SUBMITTED, S.RUNNING),
        (S.SUBMITTED, S.SUCCEEDED),
        (S.SUBMITTED, S.FAILED),
        (S.SUBMITTED, S.CANCELED),
        (S.QUEUED, S.RUNNING),
        (S.QUEUED, S.SUCCEEDED),
        (S.QUEUED, S.FAILED),
        (S.QUEUED, S.CANCELED),
        (S.RUNNING, S.SUCCEEDED),
        (S.RUNNING, S.FAILED),
        (S.RUNNING, S.CANCELED),
        (S.UNCERTAIN, S.REJECTED),
        (S.SUBMITTED, S.STALLED),
        (S.QUEUED, S.STALLED),
        (S.RUNNING, S.STALLED),
        (S.STALLED, S.SUBMITTED),
        (S.STALLED, S.FAILED),
        (S.REJECTED, S.SUBMITTED),
        (S.ACCEPTED, S.CANCELED),  # a cancellation before the claim (migration 0012)
    }
)

ALL_PAIRS = list(itertools.product(S, S))


def test_enum_values_are_the_architecture_words() -> None:
    assert [s.value for s in S] == [
        "accepted",
        "submitting",
        "submitted",
        "queued",
        "running",
        "succeeded",
        "failed",
        "canceled",
        "uncertain",
        "rejected",
        "stalled",
    ]


@pytest.mark.parametrize(("current", "new"), ALL_PAIRS, ids=[f"{a.value}->{b.value}" for a, b in ALL_PAIRS])
def test_can_transition_every_pair(current: OperationState, new: OperationState) -> None:
    assert can_transition(current, new) is ((current, new) in LEGAL)


def test_table_size() -> None:
    assert len(ALL_PAIRS) == 121
    assert sum(can_transition(a, b) for a, b in ALL_PAIRS) == len(LEGAL) == 25


@pytest.mark.parametrize("state", list(S))
def test_same_state_is_not_a_transition(state: OperationState) -> None:
    assert can_transition(state, state) is False


@pytest.mark.parametrize("terminal", [S.SUCCEEDED, S.FAILED, S.CANCELED])
def test_terminal_never_changes(terminal: OperationState) -> None:
    assert [s for s in S if can_transition(terminal, s)] == []


def test_rejected_is_left_only_by_adopting_a_job_created_after_the_decision() -> None:
    assert [s for s in S if can_transition(S.REJECTED, s)] == [S.SUBMITTED]
    assert set(CONDITIONAL) == {(S.REJECTED, S.SUBMITTED)}
    assert is_terminal(S.REJECTED)  # nothing automatic moves it


def test_late_running_never_replaces_succeeded() -> None:
    assert can_transition(S.SUCCEEDED, S.RUNNING) is False
    assert can_transition(S.SUCCEEDED, S.QUEUED) is False
    assert can_transition(S.RUNNING, S.QUEUED) is False


def test_uncertain_only_to_submitted_or_rejected() -> None:
    assert [s for s in S if can_transition(S.UNCERTAIN, s)] == [S.SUBMITTED, S.REJECTED]


def test_stalled_is_entered_only_from_pollable_states_and_left_only_to_submitted_or_failed() -> None:
    assert [s for s in S if can_transition(s, S.STALLED)] == [S.SUBMITTED, S.QUEUED, S.RUNNING]
    assert [s for s in S if can_transition(S.STALLED, s)] == [S.SUBMITTED, S.FAILED]
    assert not is_terminal(S.STALLED)


def test_nothing_reenters_accepted_or_submitting_except_the_claim() -> None:
    assert [a for a in S if can_transition(a, S.ACCEPTED)] == []
    assert [a for a in S if can_transition(a, S.SUBMITTING)] == [S.ACCEPTED]


def test_is_terminal() -> None:
    assert {s for s in S if is_terminal(s)} == {S.SUCCEEDED, S.FAILED, S.CANCELED, S.REJECTED}


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("queued", S.QUEUED),
        ("pending", S.QUEUED),
        ("running", S.RUNNING),
        ("in_progress", S.RUNNING),
        ("succeeded", S.SUCCEEDED),
        ("completed", S.SUCCEEDED),
        ("failed", S.FAILED),
        ("canceled", S.CANCELED),
        ("cancelled", S.CANCELED),
        ("  RUNNING ", S.RUNNING),
        ("Succeeded", S.SUCCEEDED),
        ("", None),
        ("unknown", None),
        ("rejected", None),
        ("uncertain", None),
        ("submitted", None),
        ("stalled", None),
        ("aborted", None),
        ("paused", None),
    ],
)
def test_state_for_remote_status(status: str, expected: OperationState | None) -> None:
    assert state_for_remote_status(status) == expected
