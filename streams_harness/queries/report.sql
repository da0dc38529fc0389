-- Named queries for reports and progress (read-only).

-- name: run_operations
-- :operation_pattern operation id LIKE pattern. One row per operation with its reason code, final-transition time, output
-- count and saved remote job id.
SELECT o.operation_id,
       o.state::text AS state,
       o.reason_code,
       floor(extract(epoch FROM o.accepted_at) * 1000)::bigint AS accepted_at_ms,
       (SELECT floor(extract(epoch FROM max(t.at)) * 1000)::bigint
        FROM transitions t WHERE t.operation_id = o.operation_id) AS final_at_ms,
       (SELECT count(*) FROM outputs u WHERE u.operation_id = o.operation_id)::integer AS outputs,
       o.remote_job_id
FROM operations o
WHERE o.operation_id LIKE :operation_pattern;

-- name: run_publications
-- :operation_pattern operation id LIKE pattern. The publication time (ms since the epoch) of each outbox row of the run's
-- operations that the relay published (Kafka acknowledged it), in order.
SELECT floor(extract(epoch FROM published_at) * 1000)::bigint AS published_at_ms
FROM outbox
WHERE operation_id LIKE :operation_pattern AND published_at IS NOT NULL
ORDER BY published_at;

-- name: run_progress
-- :operation_pattern operation id LIKE pattern. state -> count, plus unpublished outbox rows and uncertain operations whose
-- lookup is still to come (lookup_pending; meaningful only with lookup on).
SELECT state::text AS state, count(*)::integer AS n
FROM operations WHERE operation_id LIKE :operation_pattern
GROUP BY state
UNION ALL
SELECT 'outbox_pending', count(*)::integer FROM outbox WHERE operation_id LIKE :operation_pattern AND published_at IS NULL
UNION ALL
SELECT 'lookup_pending', count(*)::integer FROM operations
WHERE operation_id LIKE :operation_pattern AND state = 'uncertain' AND lookup_gave_up_at IS NULL;

-- name: try_main_job_lock
-- One main job at a time per ledger: a session-level advisory lock, held until the connection closes.
SELECT pg_try_advisory_lock(hashtext('generation-streams:main-job'));

-- name: run_transitions
-- :operation_pattern operation id LIKE pattern. The transition log of the run's operations, in order.
SELECT operation_id, from_state::text AS from_state, to_state::text AS to_state
FROM transitions
WHERE operation_id LIKE :operation_pattern
ORDER BY operation_id, id;

-- name: run_reconciled
-- :operation_pattern operation id LIKE pattern. How uncertain operations left uncertain: adopted by the reconciler's lookup
-- (automatic), adopted or abandoned by an operator (by_person), or the same POST's late answer (late_answer).
SELECT count(*) FILTER (WHERE t.to_state = 'submitted' AND j.learned_via = 'lookup')::integer AS automatic,
       count(*) FILTER (WHERE (t.to_state = 'submitted' AND j.learned_via = 'adopted')
                           OR t.to_state = 'rejected')::integer AS by_person,
       count(*) FILTER (WHERE t.to_state = 'submitted'
                          AND j.learned_via IN ('post_2xx', 'post_502'))::integer AS late_answer
FROM transitions t
JOIN operations o USING (operation_id)
LEFT JOIN remote_jobs j ON j.remote_job_id = o.remote_job_id
WHERE t.operation_id LIKE :operation_pattern AND t.from_state = 'uncertain';

-- name: run_callbacks
-- :operation_pattern operation id LIKE pattern. The completion callbacks the workers recorded for the run's operations
-- (docs/callbacks.md): received (verified deliveries, each webhook id once) and made_due (those that moved a poll to
-- now).
SELECT count(*)::integer AS received, count(*) FILTER (WHERE poll_made_due)::integer AS made_due
FROM callback_deliveries
WHERE operation_id LIKE :operation_pattern;

-- name: operation_states
-- :operation_ids operation ids (text[]). The state of each of them the ledger holds (the harness's cancellations
-- wait for a job id saved).
SELECT operation_id, state::text AS state FROM operations WHERE operation_id = ANY(:operation_ids);

-- name: run_cancellations
-- :operation_pattern operation id LIKE pattern. The run's recorded cancellations by the state the operation was in
-- when asked (not_in_ledger: the cancellation overtook its submission).
SELECT coalesce(state_when_asked::text, 'not_in_ledger') AS state, count(*)::integer AS n
FROM cancellations
WHERE operation_id LIKE :operation_pattern
GROUP BY 1
ORDER BY 1;
