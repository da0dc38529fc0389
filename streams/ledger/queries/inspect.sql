-- Named queries that read the ledger for the people who run it: `streams operations list|show` and the live
-- view of each worker's web server (streams.oncall.operations, streams.oncall.liveview). Read-only: none of them writes.
-- Loaded by streams.ledger.sql.Queries. Ages are seconds (float8) since the operation entered its current state
-- (operations.state_entered_at, kept by the operations_guard trigger), on the database's clock.

-- name: list_operations
-- Operations, oldest in their state first.
-- :states (text[], NULL for all), :older_than_s in that state for longer than (s, float8, NULL for any), :limit.
-- Returns operation_id, state, state_age_s, reason, reason_code, remote_job_id, fencing_token, matched (rows
-- before LIMIT).
SELECT operation_id, state::text AS state, extract(epoch FROM now() - state_entered_at)::float8 AS state_age_s,
       reason, reason_code, remote_job_id, fencing_token, count(*) OVER ()::integer AS matched
FROM operations
WHERE (:states::text[] IS NULL OR state::text = ANY(:states::text[]))
  AND (:older_than_s::float8 IS NULL OR state_entered_at < now() - make_interval(secs => :older_than_s::float8))
ORDER BY state_entered_at, operation_id
LIMIT :limit;

-- name: operation_row
-- :operation_id. One row or none: the operation's columns an operator reads, and how long it has been in its
-- state (state_age_s).
SELECT o.operation_id, o.state::text AS state, o.remote_job_id, o.fencing_token, o.reason, o.reason_code,
       o.request, o.submitted_at_ms, o.source, o.poll_count, o.next_poll_at, o.last_observation,
       o.last_observed_at, o.remote_completed_at, o.accepted_at, o.updated_at, o.updated_by, o.transition_seq,
       o.state_entered_at, o.observing_since, o.unknown_status_count, o.next_lookup_at, o.lookup_count,
       o.lookup_gave_up_at,
       extract(epoch FROM now() - o.state_entered_at)::float8 AS state_age_s
FROM operations o
WHERE o.operation_id = :operation_id;

-- name: operation_transitions
-- :operation_id. The transition log of the operation, in order: seq, from_state (NULL for the first),
-- to_state, fencing_token, reason, worker (or the operator who decided), at.
SELECT id, seq, from_state::text AS from_state, to_state::text AS to_state, fencing_token, reason, worker, at
FROM transitions
WHERE operation_id = :operation_id
ORDER BY id;

-- name: operation_outputs
-- :operation_id. Each output with its outbox row (event_id, created_at, published_at; NULL when missing).
SELECT x.output_id, x.position, x.payload, x.recorded_at, b.event_id, b.created_at AS outbox_created_at,
       b.published_at
FROM outputs x
LEFT JOIN outbox b ON b.operation_id = x.operation_id AND b.output_id = x.output_id
WHERE x.operation_id = :operation_id
ORDER BY x.position, x.output_id;

-- name: operation_remote_calls
-- :operation_id. Every remote call made for the operation, in order, with its classified outcome.
SELECT id, method, status_code, outcome, remote_job_id, duration_ms, fencing_token, worker, at
FROM remote_calls
WHERE operation_id = :operation_id
ORDER BY id;

-- name: operation_remote_jobs
-- :operation_id. The accounting records of the remote jobs learned of for the operation (how, by whom, when,
-- last status, outcome, charge) with the refunds recorded for each (jsonb array, empty when none).
SELECT j.remote_job_id, j.learned_via, j.learned_by, j.learned_at, j.last_status, j.outcome, j.outcome_at,
       j.charge, COALESCE((SELECT jsonb_agg(r.refund ORDER BY r.recorded_at) FROM refunds r
                           WHERE r.remote_job_id = j.remote_job_id), '[]'::jsonb) AS refunds
FROM remote_jobs j
WHERE j.operation_id = :operation_id
ORDER BY j.learned_at, j.remote_job_id;

-- name: state_counts
-- Operations by state (states without operations are absent). Returns state, operations.
SELECT state::text AS state, count(*)::integer AS operations
FROM operations
GROUP BY 1;

-- name: state_queue
-- Operations in one state, oldest first, for an on-call queue.
-- :state (text), :limit. Returns operation_id, remote_job_id, reason, reason_code, state_age_s, matched.
SELECT operation_id, remote_job_id, reason, reason_code, extract(epoch FROM now() - state_entered_at)::float8 AS state_age_s,
       count(*) OVER ()::integer AS matched
FROM operations
WHERE state::text = :state
ORDER BY state_entered_at, operation_id
LIMIT :limit;

-- name: late_jobs
-- Jobs a POST answer reported after an operator decided their operation, not observed for it (accounted
-- 'created_after_decision'), oldest first, for the on-call overview.
-- :limit. Returns operation_id, remote_job_id, state (the operation's), learned_age_s, matched.
SELECT j.operation_id, j.remote_job_id, o.state::text AS state,
       extract(epoch FROM now() - j.learned_at)::float8 AS learned_age_s, count(*) OVER ()::integer AS matched
FROM remote_jobs j JOIN operations o USING (operation_id)
WHERE j.learned_via = 'created_after_decision' AND o.remote_job_id IS DISTINCT FROM j.remote_job_id
ORDER BY j.learned_at, j.remote_job_id
LIMIT :limit;

-- name: transitions_per_minute
-- Transitions of the last :window_min minutes (the current, partial minute included), by minute and target state.
-- Returns minute (timestamptz, start of the minute), to_state, transitions.
SELECT date_trunc('minute', at) AS minute, to_state::text AS to_state, count(*)::integer AS transitions
FROM transitions
WHERE at >= date_trunc('minute', now()) - make_interval(mins => :window_min::integer - 1)
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

-- name: posts_per_operation
-- POST attempts per operation, of the operations matching :operation_pattern (LIKE pattern): every attempt (429 and never-sent
-- retries included) and those that may have created a job (every outcome but those of :nothing_created_outcomes, text[]: the provider
-- said no job, or nothing reached it). The second must never exceed 1. Of the operations the ledger holds, since their
-- acceptance: the calls of an id streams purge --ids-older-than freed (before the acceptance of the operation holding
-- it now, or of no operation held) belong to one or more former operations, told apart by nothing, and are only
-- counted (former_ids: the ids with such POSTs; each was checked while its operation was held).
-- Returns operations, mean_attempts, max_attempts, max_sent, operations_sent_twice, former_ids.
WITH per_op AS (
    SELECT c.operation_id,
           (o.operation_id IS NULL OR c.at < o.accepted_at) AS former,
           count(*) AS attempts,
           count(*) FILTER (WHERE c.outcome <> ALL(:nothing_created_outcomes::text[])) AS sent
    FROM remote_calls c LEFT JOIN operations o USING (operation_id)
    WHERE c.method = 'POST' AND c.operation_id LIKE :operation_pattern
    GROUP BY 1, 2
)
SELECT count(*) FILTER (WHERE NOT former)::integer AS operations,
       round(avg(attempts) FILTER (WHERE NOT former), 3)::float8 AS mean_attempts,
       COALESCE(max(attempts) FILTER (WHERE NOT former), 0)::integer AS max_attempts,
       COALESCE(max(sent) FILTER (WHERE NOT former), 0)::integer AS max_sent,
       count(*) FILTER (WHERE sent > 1 AND NOT former)::integer AS operations_sent_twice,
       count(*) FILTER (WHERE former)::integer AS former_ids
FROM per_op;
