"""The shapes the ledger's statements return: claims, due polls, save outcomes and operators' moves."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field

from streams.model.codes import RemoteCallOutcome
from streams.model.states import POLLABLE, OperationState, can_transition, is_terminal


class SaveOutcome(enum.StrEnum):
    """What happened to a fenced save."""

    SAVED = "saved"  # written (a transition, or a refresh of the same state)
    #: written, and the job's next poll is due now instead of after its delay: a cancellation not yet called at the
    #: provider, or a completion callback that came while this poll was being observed (queries/ledger.sql)
    SAVED_DUE_NOW = "saved_due_now"
    REFUSED_FENCING = "refused_fencing"  # a newer claim exists: the caller drops its result
    REFUSED_ORDER = "refused_order"  # the row is already at or past this state (e.g. late running)


@dataclass(frozen=True, slots=True)
class RemoteCall:
    """One remote call attempt as the ledger's accounting records it (a ``remote_calls`` row): ``method``
    (``POST``, ``GET``, ``CANCEL``), the HTTP ``status_code`` (None: no answer), its classified ``outcome``, the
    ``remote_job_id`` it named or reported, ``duration_ms`` and the caller's ``fencing_token``. ``call_id`` names
    the row (a new one by default): the same record sent again is written once."""

    operation_id: str
    method: str
    status_code: int | None
    outcome: RemoteCallOutcome
    remote_job_id: str | None
    duration_ms: float
    fencing_token: int | None
    call_id: uuid.UUID = field(default_factory=uuid.uuid4)


@dataclass(frozen=True)
class ClaimBound:
    """The scheduler's back-pressure on poll claims (:mod:`streams.worker.stages.scheduler`): the polls claimed and not
    yet taken
    by an observer stay at most ``max(least, taken * take_target_s / pace_window_s)``, where ``taken`` is the number
    of polls the observers of every worker took in the last ``pace_window_s`` seconds (read from the ledger)."""

    #: The bound when the observers took few or none lately (polls).
    least: int
    #: How far back the observers' pace is read (s, > 0).
    pace_window_s: float
    #: How long the claimed polls may wait for an observer at that pace (s).
    take_target_s: float


@dataclass(frozen=True)
class SchedulerDue:
    """When the poll scheduler has work next, in seconds from now (negative: due already; None: none of that kind):
    ``poll_due_in_s`` the earliest poll of a pollable operation, ``reconcile_due_in_s`` the earliest operation left
    ``submitting`` or ``accepted`` past its stale-after age."""

    poll_due_in_s: float | None
    reconcile_due_in_s: float | None


@dataclass(frozen=True)
class DuePoll:
    """One poll claimed by the scheduler; ``claimed_at_ms``: when, in epoch ms of the database's clock."""

    operation_id: str
    remote_job_id: str
    poll_claim_id: int
    claimed_at_ms: int


@dataclass(frozen=True)
class ObserveClaim:
    """The observer's claim: the fencing value every save must name; ``observed_for_s`` is how long the job has
    been observed (since its id was saved or an operator repolled it), by the database's clock."""

    fencing_token: int
    remote_job_id: str
    state: OperationState
    poll_count: int
    observed_for_s: float = 0.0
    #: A cancellation is recorded for the operation (docs/cancellation.md).
    cancel_asked: bool = False
    #: The provider's cancel route gave a definite answer: it is not called again.
    cancel_answered: bool = False
    #: Calls of the cancel route made so far.
    cancel_attempts: int = 0


@dataclass(frozen=True)
class FirstPollClaim:
    """A job's first poll, claimed for the saving worker by the save of its job id (``save_submitted`` with a first
    poll claim id): the poll claim a reschedule names and the observer's claim every save must name."""

    poll_claim_id: int
    claim: ObserveClaim


class CancelPath(enum.StrEnum):
    """How a cancellation was asked (``cancellations.path``)."""

    TOPIC = "topic"  # an application's message on generation.cancellations
    OPERATOR = "operator"  # `streams operations cancel`


@dataclass(frozen=True)
class CancelAsk:
    """What :meth:`~streams.ledger.store.Ledger.request_cancel` did: ``state_when_asked`` is the operation's state
        (None: not in the ledger yet), ``recorded`` False when a cancellation was already recorded (nothing written),
        ``canceled_now`` True when the operation went ``accepted -> canceled`` (no POST will be sent), ``poll_made_due``
    True when its job's poll moved to now (the observer then calls the provider's cancel route)."""

    operation_id: str
    state_when_asked: OperationState | None
    recorded: bool
    canceled_now: bool
    poll_made_due: bool = False


@dataclass(frozen=True)
class CallbackNote:
    """What :meth:`~streams.ledger.store.Ledger.note_callback` did: ``operation_id`` None when no operation has the
    job id (nothing recorded), ``recorded`` False for a replay (the webhook id was recorded before), ``made_due``
    True when the job's poll moved to now, ``hinted`` True when the callback came while the poll was claimed or
    being observed, or made it due (``hinted_at`` stamped: the save of a poll being observed then makes the next
    one due now)."""

    operation_id: str | None
    recorded: bool
    made_due: bool
    hinted: bool = False


#: How much earlier than an operation's acceptance (the database's clock) a job found by lookup may say it was
#: created (the provider's clock) and still be taken for that operation's: clocks disagree by seconds, while a former
#: operation of the same id was purged and its id freed at least this long before (``streams purge
#: --ids-older-than`` refuses a shorter horizon).
FORMER_JOB_MARGIN_S = 86_400.0


@dataclass(frozen=True)
class LookupClaim:
    """The reconciler's claim of one ``uncertain`` operation for a lookup: the fencing value its save must name,
    how long the operation has been uncertain (s), the lookups claimed so far (this one included), when the
    operation was accepted (epoch ms, the database's clock; None: not known), the jobs the accounting learned for its
    id before that (a former operation's of the same id), and whether the accounting holds calls of the id from
    before it (a former operation was sent)."""

    operation_id: str
    fencing_token: int
    uncertain_for_s: float
    lookup_count: int
    accepted_at_ms: int | None = None
    former_job_ids: frozenset[str] = frozenset()
    had_former: bool = False


def sources_for(new: OperationState) -> list[str]:
    """States over which an observation of ``new`` may be saved: its legal predecessors among the pollable
    states, plus ``new`` itself when not terminal (a refresh). Never over ``stalled``: only an operator moves
    work out of it."""
    allowed = [s.value for s in OperationState if s in POLLABLE and can_transition(s, new)]
    if not is_terminal(new) and new in POLLABLE:
        allowed.append(new.value)
    return allowed


@dataclass(frozen=True)
class OperatorMove:
    """The result of an operator's decision: the transition written.

    ``transition_seq`` is the operation's transition sequence number (the event id is
    ``transition:<operation_id>:<transition_seq>:<to_state>``); ``fencing_token`` the value the decision took.
    """

    operation_id: str
    action: str
    from_state: OperationState
    to_state: OperationState
    transition_seq: int
    fencing_token: int
