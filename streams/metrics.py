"""Prometheus metrics of one worker process (served at ``/metrics`` by the worker's web server)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

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
RECONCILED_UNCERTAIN = Counter(
    "streams_reconciled_uncertain_total", "Operations found stuck in submitting and marked uncertain."
)
OUTBOX_PUBLISHED = Counter("streams_outbox_published_total", "Outbox rows published.", ["topic_role"])
SUBMISSIONS = Counter("streams_submissions_total", "Submission events by result.", ["result"])
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
