-- Named queries that read the ledger for the people who run it: `streams operations list|show` and the live
-- view of each worker's web server (streams.operators, streams.web). Read-only: none of them writes.
-- Loaded by streams.sql.Queries. Ages are seconds (float8) since the operation entered its current state, taken
-- from the transition log (the newest row of the operation), so they do not move when a claim touches the row.

-- name: list_operations
-- Operations, oldest in their state first.
-- $1 states (text[], NULL for all), $2 in that state for longer than (s, float8, NULL for any), $3 limit.
-- Returns operation_id, state, state_age_s, reason, remote_job_id, fencing_token, matched (rows before LIMIT).
WITH entered AS (
    SELECT o.operation_id, o.state::text AS state, o.reason, o.remote_job_id, o.fencing_token,
           COALESCE((SELECT max(t.at) FROM transitions t WHERE t.operation_id = o.operation_id), o.accepted_at)
               AS entered_at
    FROM operations o
    WHERE $1::text[] IS NULL OR o.state::text = ANY($1::text[])
)
SELECT operation_id, state, extract(epoch FROM now() - entered_at)::float8 AS state_age_s, reason, remote_job_id,
       fencing_token, count(*) OVER ()::integer AS matched
FROM entered
WHERE $2::float8 IS NULL OR entered_at < now() - make_interval(secs => $2::float8)
ORDER BY entered_at, operation_id
LIMIT $3;

-- name: operation_row
-- $1 operation_id. One row or none: the operation's columns an operator reads, and how long it has been in its
-- state (state_age_s).
SELECT o.operation_id, o.state::text AS state, o.remote_job_id, o.fencing_token, o.reason, o.request,
       o.submitted_at_ms, o.source, o.poll_count, o.next_poll_at, o.last_observation, o.last_observed_at, o.remote_completed_at,
       o.accepted_at, o.updated_at, o.updated_by,
       extract(epoch FROM now() - COALESCE(
           (SELECT max(t.at) FROM transitions t WHERE t.operation_id = o.operation_id), o.accepted_at))::float8
           AS state_age_s
FROM operations o
WHERE o.operation_id = $1;

-- name: operation_transitions
-- $1 operation_id. The transition log of the operation, in order: from_state (NULL for the first), to_state,
-- fencing_token, reason, worker (or the operator who decided), at.
SELECT id, from_state::text AS from_state, to_state::text AS to_state, fencing_token, reason, worker, at
FROM transitions
WHERE operation_id = $1
ORDER BY id;

-- name: operation_outputs
-- $1 operation_id. Each output with its outbox row (event_id, created_at, published_at; NULL when missing).
SELECT x.output_id, x.position, x.payload, x.recorded_at, b.event_id, b.created_at AS outbox_created_at,
       b.published_at
FROM outputs x
LEFT JOIN outbox b ON b.operation_id = x.operation_id AND b.output_id = x.output_id
WHERE x.operation_id = $1
ORDER BY x.position, x.output_id;

-- name: operation_remote_calls
-- $1 operation_id. Every remote call made for the operation, in order, with its classified outcome.
SELECT id, method, status_code, outcome, remote_job_id, duration_ms, fencing_token, worker, at
FROM remote_calls
WHERE operation_id = $1
ORDER BY id;

-- name: state_counts
-- Operations by state (states without operations are absent). Returns state, operations.
SELECT state::text AS state, count(*)::integer AS operations
FROM operations
GROUP BY 1;

-- name: state_queue
-- Operations in one state, oldest first, for an on-call queue.
-- $1 state (text), $2 limit. Returns operation_id, remote_job_id, reason, state_age_s, matched.
WITH entered AS (
    SELECT o.operation_id, o.remote_job_id, o.reason,
           COALESCE((SELECT max(t.at) FROM transitions t WHERE t.operation_id = o.operation_id), o.accepted_at)
               AS entered_at
    FROM operations o
    WHERE o.state::text = $1
)
SELECT operation_id, remote_job_id, reason, extract(epoch FROM now() - entered_at)::float8 AS state_age_s,
       count(*) OVER ()::integer AS matched
FROM entered
ORDER BY entered_at, operation_id
LIMIT $2;

-- name: transitions_per_minute
-- Transitions of the last $1 minutes (the current, partial minute included), by minute and target state.
-- Returns minute (timestamptz, start of the minute), to_state, transitions.
SELECT date_trunc('minute', at) AS minute, to_state::text AS to_state, count(*)::integer AS transitions
FROM transitions
WHERE at >= date_trunc('minute', now()) - make_interval(mins => $1::integer - 1)
GROUP BY 1, 2
ORDER BY 1, 2;

-- name: outbox_backlog
-- Outbox rows not yet published, by topic role, with the age of the oldest (s).
-- Returns topic_role, unpublished, oldest_age_s.
SELECT topic_role, count(*)::integer AS unpublished,
       extract(epoch FROM now() - min(created_at))::float8 AS oldest_age_s
FROM outbox
WHERE published_at IS NULL
GROUP BY 1
ORDER BY 1;

-- name: database_now
-- The database's clock (timestamptz): the reference of every age shown.
SELECT now();
