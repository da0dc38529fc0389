"""Machine codes stored in the ledger beside what people read: remote-call outcomes and reason codes.

Each enumeration is mirrored by a reference table of the ledger (migration ``0003``): ``remote_calls.outcome``
references ``remote_call_outcomes`` and ``operations.reason_code`` references ``reason_codes``, so a value
unknown to the database is refused on insert. Adding a member means adding its row in a new migration
(``tests/integration/test_migrations.py`` checks both sides agree).
"""

from __future__ import annotations

import enum

from streams.model.states import OperationState


class RemoteCallOutcome(enum.StrEnum):
    """The classified outcome of one remote call attempt (``remote_calls.outcome``)."""

    # POST
    CREATED = "created"  # 2xx with a job id
    CREATED_VIA_502 = "created_via_502"  # 502 whose error names the job id
    REFUSED = "refused"  # a definite 4xx: nothing created
    RATE_LIMITED = "rate_limited"  # 429 (POST, GET or lookup)
    NOT_SENT = "not_sent"  # no byte left this process
    UNKNOWN_OUTCOME = "unknown_outcome"  # sent, answer unknown: a job may exist
    # GET answered: the operation state the provider's status maps to
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    # GET not usable
    JOB_NOT_FOUND = "job_not_found"
    UNKNOWN_STATUS = "unknown_status"
    CONTRACT_VIOLATION = "contract_violation"
    TRANSIENT = "transient"  # failed in a retryable way
    ABANDONED = "abandoned"  # cut off after it was sent
    # lookup by client reference (a GET)
    LOOKUP_FOUND_0 = "lookup_found_0"
    LOOKUP_FOUND_1 = "lookup_found_1"
    LOOKUP_FOUND_2 = "lookup_found_2"
    LOOKUP_FOUND_3 = "lookup_found_3"
    LOOKUP_FOUND_4 = "lookup_found_4"
    LOOKUP_FOUND_5 = "lookup_found_5"
    LOOKUP_FOUND_6 = "lookup_found_6"
    LOOKUP_FOUND_7 = "lookup_found_7"
    LOOKUP_FOUND_8 = "lookup_found_8"
    LOOKUP_FOUND_9_OR_MORE = "lookup_found_9"
    LOOKUP_REFUSED = "lookup_refused"
    LOOKUP_RATE_LIMITED = "lookup_rate_limited"
    LOOKUP_CONTRACT_VIOLATION = "lookup_contract_violation"
    LOOKUP_TRANSIENT = "lookup_transient"
    # the provider's cancel route (method CANCEL)
    CANCEL_ACCEPTED = "cancel_accepted"  # 2xx: the provider accepted the cancel
    CANCEL_ALREADY_TERMINAL = "cancel_already_terminal"  # 409: the job had already ended
    CANCEL_NOT_FOUND = "cancel_not_found"  # 404: no such job
    CANCEL_REFUSED = "cancel_refused"  # another 4xx: refused definitely
    CANCEL_UNKNOWN_OUTCOME = "cancel_unknown_outcome"  # 429, 5xx, a timeout, not sent: asked again later

    @classmethod
    def answered(cls, state: OperationState) -> RemoteCallOutcome:
        """The outcome of a GET whose status maps to ``state`` (queued, running or a terminal state).

        Raises:
            ValueError: ``state`` is not one a remote status maps to.
        """
        return cls(state.value)

    @classmethod
    def lookup_found(cls, jobs: int) -> RemoteCallOutcome:
        """The outcome of a lookup that found ``jobs`` jobs (9 and more share one code)."""
        return cls(f"lookup_found_{min(max(jobs, 0), 9)}")

    @classmethod
    def of_lookup(cls, outcome: RemoteCallOutcome) -> RemoteCallOutcome:
        """The lookup form of a failed call's ``outcome`` (``refused`` -> ``lookup_refused``, ...).

        Raises:
            KeyError: ``outcome`` is not one a lookup fails with.
        """
        return _LOOKUP_FAILURES[outcome]


_LOOKUP_FAILURES = {
    RemoteCallOutcome.REFUSED: RemoteCallOutcome.LOOKUP_REFUSED,
    RemoteCallOutcome.RATE_LIMITED: RemoteCallOutcome.LOOKUP_RATE_LIMITED,
    RemoteCallOutcome.CONTRACT_VIOLATION: RemoteCallOutcome.LOOKUP_CONTRACT_VIOLATION,
    RemoteCallOutcome.TRANSIENT: RemoteCallOutcome.LOOKUP_TRANSIENT,
    RemoteCallOutcome.ABANDONED: RemoteCallOutcome.LOOKUP_TRANSIENT,
    RemoteCallOutcome.NOT_SENT: RemoteCallOutcome.LOOKUP_TRANSIENT,
    RemoteCallOutcome.UNKNOWN_OUTCOME: RemoteCallOutcome.LOOKUP_TRANSIENT,
    RemoteCallOutcome.JOB_NOT_FOUND: RemoteCallOutcome.LOOKUP_TRANSIENT,
    RemoteCallOutcome.UNKNOWN_STATUS: RemoteCallOutcome.LOOKUP_TRANSIENT,
}


class ReasonCode(enum.StrEnum):
    """Why an operation carries its reason (``operations.reason_code``, stored beside the text ``reason`` people
    read; a report groups by it). The ledger keeps both set or both empty; rows written before the codes
    existed carry :attr:`UNCLASSIFIED`."""

    UNCLASSIFIED = "unclassified"  # written before reason codes existed
    JOB_ID_VIA_ERROR = "job_id_via_error"  # submitted: the job id came from a 502's error.job_id
    REFUSED = "refused"  # rejected: a definite 4xx
    RATE_LIMITED = "rate_limited"  # rejected: still 429 at the submit retry deadline
    NOT_SENT = "not_sent"  # rejected: never sent within the submit retry deadline
    UNKNOWN_OUTCOME = "unknown_outcome"  # uncertain: sent, answer unknown
    JOB_ID_NOT_SAVED = "job_id_not_saved"  # uncertain: a job was created but its id could not be saved
    NO_OUTCOME_SAVED = "no_outcome_saved"  # uncertain: left in submitting (dispatcher died mid-POST)
    NOT_FOUND_BY_LOOKUP = "not_found_by_lookup"  # uncertain: the reconciler's lookup found no job
    ADOPTED_BY_LOOKUP = "adopted_by_lookup"  # submitted: the reconciler adopted the job it found
    REMOTE_JOB_FAILED = "remote_job_failed"  # failed: the provider's error (or an unusable answer)
    MAX_AGE = "max_age"  # stalled: observed too long without reaching a terminal state
    JOB_NOT_FOUND = "job_not_found"  # stalled: 404 past the grace window
    UNKNOWN_STATUS = "unknown_status"  # stalled: unknown statuses in a row
    POLL_FAILURES = "poll_failures"  # stalled: failed polls in a row (unusable answers, timeouts, 429s)
    ADOPTED_BY_OPERATOR = "adopted_by_operator"
    ABANDONED_BY_OPERATOR = "abandoned_by_operator"
    REPOLLED_BY_OPERATOR = "repolled_by_operator"
    FAILED_BY_OPERATOR = "failed_by_operator"
    ADOPTED_AFTER_DECISION = "adopted_after_decision"  # submitted: an operator adopted a job created after abandon
    CANCELED_BEFORE_SUBMIT = "canceled_before_submit"  # canceled: asked before the claim, no POST sent


#: The setbacks a poll without a usable observation counts (``Ledger.note_poll_setback``): each kind has its own
#: count in a row, and the limit-th makes the operation ``stalled`` with that reason code.
POLL_SETBACKS = frozenset({ReasonCode.UNKNOWN_STATUS, ReasonCode.POLL_FAILURES})


class CallbackRefusal(enum.StrEnum):
    """Why a completion callback was refused (docs/callbacks.md): the bounded ``reason`` label of
    ``streams_callbacks_refused_total``. Not stored in the ledger (a refused delivery records nothing)."""

    MALFORMED_HEADERS = "malformed_headers"  # 400: a Standard Webhooks header missing, empty or malformed
    BAD_SIGNATURE = "bad_signature"  # 401: no v1 signature matches a configured secret
    STALE_TIMESTAMP = "stale_timestamp"  # 401: webhook-timestamp outside the tolerance
    BODY_TOO_LARGE = "body_too_large"  # 413: over callback_max_body_bytes
    BODY_TIMEOUT = "body_timeout"  # 408: the body did not arrive within callback_body_timeout_s
    MALFORMED_BODY = "malformed_body"  # 400: not JSON, or no data.id
    UNKNOWN_JOB = "unknown_job"  # 404: no operation has the job id (yet): the sender retries
    REPLAY = "replay"  # 200: the webhook-id was recorded before; acknowledged so the sender stops
