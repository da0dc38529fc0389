"""Prometheus metrics of one worker process (served at ``/metrics`` by the worker's web server).

Counters count this process's events since it started; every counter is exported from the start, at 0 for each
known label value (:func:`preinitialise`), so a rate and an alert see the series before its first event. The
gauges are the figures of the worker's periodic snapshot (:mod:`streams.oncall.snapshot`, every
``web_snapshot_interval_s``): the ledger's and Kafka's state, the same in every worker.
Names and units follow the Prometheus conventions (``_total``, ``_seconds``). No ``_created`` series: they would
double the page (one per counter and histogram child) and no rule or dashboard reads them; disabled at import,
before any metric is made (``prometheus_client.disable_created_metrics``).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

from streams.model.codes import CallbackRefusal, RemoteCallOutcome
from streams.model.states import OperationState

disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated

FENCING_REFUSALS = Counter(
    "streams_fencing_refusals_total",
    "Saves refused because a newer claim holds the operation (the stale worker dropped its result).",
    ["stage"],
)
ORDER_REFUSALS = Counter(
    "streams_order_refusals_total",
    "Observations not saved because the operation is already at or past that state (e.g. late running).",
)
LEASE_BUSY = Counter("streams_lease_busy_total", "Lease held by another worker; work rescheduled.", ["action"])
LEASE_LOST = Counter(
    "streams_lease_lost_total", "Renewal found the key gone or another owner token; work stopped.", ["action"]
)
COORDINATION_UNAVAILABLE = Counter(
    "streams_coordination_unavailable_total", "Redis did not answer; no claim and no remote call made.", ["action"]
)
REDIS_POOL_BUSY = Counter(
    "streams_redis_pool_busy_total",
    "Redis commands not sent: no pooled connection came free within redis_pool_timeout_s (own load, not an outage).",
    ["action"],
)
OUTAGE_WAITS = Counter(
    "streams_outage_waits_total",
    "Failures classified as an outage of a service (connection refused/lost, timeouts), waited out.",
    ["service", "where"],
)
HANDLER_FAILURES = Counter(
    "streams_handler_failures_total",
    "Failed attempts at handling one consumed event, by topic, failure class (outage, busy, error) and what "
    "followed (retried, dead_lettered).",
    ["topic", "kind", "then"],
)
UNEXPECTED_ERRORS = Counter(
    "streams_unexpected_errors_total",
    "Failures that are not outages (programming errors, refusals that waiting cannot fix); logged with traceback.",
    ["where"],
)
HTTP_POOL_REPAIRS = Counter(
    "streams_http_pool_repairs_total",
    "HTTP pool connections orphaned by a cancelled remote call and reclaimed (see streams.remote.client._PoolRepair).",
)
ABANDONED_CALLS = Counter(
    "streams_remote_calls_abandoned_total",
    "Remote calls cut off after sending (deadline, timeout, connection lost); the lease is left to expire.",
    ["method"],
)
LEDGER_UNAVAILABLE = Counter("streams_ledger_unavailable_total", "PostgreSQL did not answer; retried.", ["what"])
LEDGER_CONFLICTS = Counter(
    "streams_ledger_conflicts_total",
    "Ledger statements PostgreSQL rolled back as a deadlock victim or serialization failure, then run again.",
    ["stage", "sqlstate"],
)
LEDGER_BATCH_FALLBACKS = Counter(
    "streams_ledger_batch_fallbacks_total",
    "Batched ledger statements run again one statement per request: refused for some request's values"
    " (refused_value), or waited too long for a lock another transaction held (lock_wait).",
    ["stage", "reason"],
)
REMOTE_CALLS = Counter("streams_remote_calls_total", "Remote API calls by classified outcome.", ["method", "outcome"])
BATCH_SIZE = Histogram(
    "streams_batch_size",
    "Requests sent in one round trip by a coalescing stage (streams.coalesce).",
    ["stage"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
REMOTE_CALL_SECONDS = Histogram("streams_remote_call_seconds", "Remote API call duration.", ["method"])
DEAD_LETTERS = Counter("streams_dead_letters_total", "Inputs sent to the dead-letter topic.", ["topic", "reason"])
STALE_POLLS = Counter("streams_stale_polls_total", "Poll events dropped because a newer claim or state exists.")
POLLS_CLAIMED = Counter("streams_polls_claimed_total", "Due polls claimed by this worker's scheduler.")
FIRST_POLLS = Counter(
    "streams_first_polls_total",
    "First polls claimed by the save of the job id and taken in this worker, by outcome (taken: its observation "
    "ran, with a GET, or without one when another holder had the lease or Redis was unavailable; given_back: made "
    "due at once for the scheduler, as the worker stopped or after a failure; failed: an error out of the "
    "observation).",
    ["outcome"],
)
#: The outcomes of :data:`FIRST_POLLS`.
FIRST_POLL_OUTCOMES = ("taken", "given_back", "failed")
RECONCILED_UNCERTAIN = Counter(
    "streams_reconciled_uncertain_total", "Operations found stuck in submitting and marked uncertain."
)
OUTBOX_PUBLISHED = Counter("streams_outbox_published_total", "Outbox rows published.", ["topic_role"])
RELAY_LOCK_MISSED = Counter(
    "streams_outbox_relay_lock_missed_total",
    "Rounds of the outbox relay that found the relay lock held by another relay (each tried again shortly).",
)
WAKEUPS = Counter(
    "streams_wakeups_total",
    "Wake-ups of a background loop (loop: schedule_polls, relay_outbox) by cause: written (this worker wrote work), "
    "notified (PostgreSQL NOTIFY of outputs from any worker, STREAMS_WAKEUP_PEER_OUTPUTS_DELAY_S after it), "
    "listening (the listener (re)connected), unlistened (it lost its connection), due (a known deadline passed), "
    "acked (a Kafka acknowledgement came after its round's wait), lock_missed (the relay found its lock held and "
    "looks again), fallback (nothing woke it within its fallback).",
    ["loop", "cause"],
)
LEDGER_LISTENER_CONNECTS = Counter(
    "streams_ledger_listener_connects_total",
    "Connections of the ledger's LISTEN connection (outbox notifications), by result: connected, failed, lost.",
    ["result"],
)
LEDGER_NOTIFICATIONS = Counter(
    "streams_ledger_notifications_total",
    "Outbox notifications the ledger's LISTEN connection received, by kind: outputs, transitions (each one costs "
    "PostgreSQL a transaction in the listening backend, beside the statements of the worker).",
    ["kind"],
)
SUBMISSIONS = Counter("streams_submissions_total", "Submission events by result.", ["result"])
CANCELLATIONS = Counter(
    "streams_cancellations_total",
    "Cancellations asked, by path (topic, operator) and what followed (canceled_before_post, at_provider: observed "
    "until the provider confirms, recorded: already terminal or waiting for a decision, repeat: already asked).",
    ["path", "result"],
)
CALLBACKS_RECEIVED = Counter(
    "streams_callbacks_received_total",
    "Completion callbacks verified and recorded, by result (poll_now: the job's poll moved to now; poll_claimed: "
    "its poll was claimed already, its GET comes after; no_change: it was due already, or the job is no longer "
    "pollable).",
    ["result"],
)
CALLBACKS_REFUSED = Counter(
    "streams_callbacks_refused_total",
    "Completion callbacks refused or acknowledged without effect, by reason (streams.model.codes.CallbackRefusal).",
    ["reason"],
)
STALLED = Counter(
    "streams_stalled_total",
    "Operations stalled because the provider's answers stopped making progress (polling stops).",
    ["kind"],
)
LOOKUPS = Counter(
    "streams_lookups_total", "Lookups of uncertain operations by client reference, by result.", ["result"]
)
DUPLICATE_CREATIONS = Counter(
    "streams_duplicate_creations_total", "Further jobs the provider created for one operation, found by lookup."
)
JOBS_CREATED_AFTER_DECISION = Counter(
    "streams_jobs_created_after_decision_total",
    "POST answers whose job arrived after an operator decided the operation (accounted created_after_decision;"
    " adopt it or cancel it at the provider: docs/decisions.md), by the operation's state then.",
    ["state"],
)
BUDGET_WAITS = Counter(
    "streams_rate_budget_waits_total",
    "Remote calls (kind POST, GET) that waited for the account's rate budget; for kind claims, scheduler rounds "
    "that claimed fewer due polls than due because of it.",
    ["kind"],
)
BUDGET_WAIT_SECONDS = Counter(
    "streams_rate_budget_wait_seconds_total", "Seconds remote calls waited for the account's rate budget.", ["kind"]
)
BUDGET_PAUSES = Counter(
    "streams_rate_budget_pauses_total",
    "429 answers whose Retry-After paused every worker's calls of that kind (POST, GET).",
    ["kind"],
)
RUNNING_SLOT_WAITS = Counter(
    "streams_running_slot_waits_total",
    "Submissions that waited for a running-job slot of the account or of their model (the concurrency budget).",
)
RUNNING_SLOT_WAIT_SECONDS = Counter(
    "streams_running_slot_wait_seconds_total", "Seconds submissions waited for a running-job slot."
)
OUTPUTS_NEAR_EXPIRY = Counter(
    "streams_outputs_near_expiry_total",
    "Outputs published to generation.outputs.delivered with less than STREAMS_OUTPUT_EXPIRY_MARGIN_S left before "
    "their expires_at_ms (already expired included).",
)

# Secured and replicated Kafka (docs/production-services.md).
SUBMISSION_RESENDS = Counter(
    "streams_submission_resends_total",
    "Submissions sent again by a new producer after a failed batch (ledger accepts an operation id once).",
    ["reason"],
)
SUBMISSION_PRODUCER_START_RETRIES = Counter(
    "streams_submission_producer_start_retries_total",
    "Replacement submission producers that could not start for an outage (no broker answered) and were retried.",
    ["reason"],
)
WEB_CONNECTIONS_REFUSED = Counter(
    "streams_web_connections_refused_total",
    "Connections to the worker's web server answered 503 at once: it held web_max_connections already.",
)
KAFKA_PARTITIONS_BLOCKED = Gauge(
    "streams_kafka_partitions_blocked",
    "1 while a product topic's partition has no leader in this worker's metadata (its writes wait), else 0.",
    ["topic", "partition"],
)
KAFKA_BLOCKED_SKIPS = Counter(
    "streams_kafka_blocked_skips_total",
    "Records the outbox relay or the poll scheduler left for a later round because their partition is blocked.",
    ["what", "topic", "partition"],
)

# The periodic snapshot's gauges (streams.oncall.snapshot).
OPERATIONS = Gauge("streams_operations", "Operations in the ledger, by state (at the last snapshot).", ["state"])
DECISION_WAITING = Gauge(
    "streams_decision_waiting",
    "Operations waiting for an operator's decision (state uncertain or stalled), at the last snapshot.",
    ["state"],
)
DECISION_OLDEST_AGE_SECONDS = Gauge(
    "streams_decision_oldest_age_seconds",
    "Seconds the oldest operation waiting for a decision has been in its state (0 when none waits).",
    ["state"],
)
OUTBOX_UNPUBLISHED = Gauge("streams_outbox_unpublished", "Outbox rows not yet published (at the last snapshot).")
OUTBOX_OLDEST_AGE_SECONDS = Gauge(
    "streams_outbox_oldest_age_seconds", "Seconds since the oldest unpublished outbox row was written (0 when none)."
)
CONSUMER_LAG = Gauge(
    "streams_consumer_lag",
    "Records of the topic not yet committed by the worker's consumer group (end offset - committed offset, summed "
    "over partitions; the whole group's, as Kafka has it).",
    ["topic"],
)
PARTITIONS_BLOCKED = Gauge(
    "streams_partitions_blocked",
    "This worker's partitions whose offset commits wait behind an event still being handled (later events done).",
    ["agent"],
)
DEAD_LETTERS_RETAINED = Gauge(
    "streams_dead_letters_retained", "Records the dead-letter topic retains (every worker's), at the last snapshot."
)
SNAPSHOT_TIMESTAMP_SECONDS = Gauge(
    "streams_snapshot_timestamp_seconds", "Unix time of the last snapshot that read the ledger (0 before the first)."
)
CLOCK_SKEW_SECONDS = Gauge(
    "streams_clock_skew_seconds",
    "This worker's wall clock minus PostgreSQL's (s; positive: ahead), at the last measurement, corrected by half "
    "the round trip (0 before the first).",
)
SNAPSHOT_FAILURES = Counter(
    "streams_snapshot_failures_total", "Snapshots of which a part could not be read (service not answering).", ["part"]
)

#: Label values of each labelled counter that :func:`preinitialise` exports at 0.
_STAGES = ("submit", "observe", "reconcile")
_ACTIONS = ("submit", "observe")
_METHODS = ("POST", "GET", "CANCEL")
#: What followed a cancellation (:data:`CANCELLATIONS`).
CANCEL_RESULTS = ("canceled_before_post", "at_provider", "recorded", "repeat")
_BUDGET_KINDS = ("POST", "GET", "claims")
#: The reasons an input is dead-lettered (``streams.errors.InvalidEventError``'s reasons).
DEAD_LETTER_REASONS = ("not_json", "oversized", "schema", "unpublishable", "processing_error")
#: The snapshot's parts (:data:`SNAPSHOT_FAILURES`).
SNAPSHOT_PARTS = ("ledger", "kafka")
#: The agents whose partitions :data:`PARTITIONS_BLOCKED` counts.
AGENTS = ("dispatch", "observe", "cancel")


def preinitialise(consumed_topics: Iterable[str]) -> None:
    """Export every counter at 0 for its known label values, and the gauges' known series: call once at a worker's
    start. ``consumed_topics``: the full names of the topics whose events may be dead-lettered (submissions,
    polls). Idempotent (``labels()`` of an existing series returns it)."""
    for stage in _STAGES:
        FENCING_REFUSALS.labels(stage)
    for action in _ACTIONS:
        LEASE_BUSY.labels(action)
        LEASE_LOST.labels(action)
    for action in (*_ACTIONS, "schedule"):
        COORDINATION_UNAVAILABLE.labels(action)
    for method in _METHODS:
        ABANDONED_CALLS.labels(method)
        for outcome in RemoteCallOutcome:
            REMOTE_CALLS.labels(method, outcome.value)
    for role in ("outputs_delivered", "transitions"):
        OUTBOX_PUBLISHED.labels(role)
    for result in ("submitted", "already_dispatched", "redispatched", "dead_letter"):
        SUBMISSIONS.labels(result)
    for path in ("topic", "operator"):
        for cancel_result in CANCEL_RESULTS:
            CANCELLATIONS.labels(path, cancel_result)
    for kind in ("max_age", "not_found", "unknown_status"):
        STALLED.labels(kind)
    for first_poll_outcome in FIRST_POLL_OUTCOMES:
        FIRST_POLLS.labels(first_poll_outcome)
    for callback_result in ("poll_now", "poll_claimed", "no_change"):
        CALLBACKS_RECEIVED.labels(callback_result)
    for refusal in CallbackRefusal:
        CALLBACKS_REFUSED.labels(refusal.value)
    for result in ("adopted", "not_found", "failed"):
        LOOKUPS.labels(result)
    for kind in _BUDGET_KINDS:
        BUDGET_WAITS.labels(kind)
        BUDGET_WAIT_SECONDS.labels(kind)
        BUDGET_PAUSES.labels(kind)
    for topic in consumed_topics:
        for reason in DEAD_LETTER_REASONS:
            DEAD_LETTERS.labels(topic, reason)
    for part in SNAPSHOT_PARTS:
        SNAPSHOT_FAILURES.labels(part)
    for operation_state in OperationState:
        OPERATIONS.labels(operation_state.value)
    for decision_state in ("uncertain", "stalled"):
        DECISION_WAITING.labels(decision_state)
        DECISION_OLDEST_AGE_SECONDS.labels(decision_state)
    for agent in AGENTS:
        PARTITIONS_BLOCKED.labels(agent)
    # Unlabelled gauges (streams_clock_skew_seconds, streams_outbox_unpublished, ...) are exported at 0 from
    # their definition: setting them here would undo a reading when this is called again.
