-- Named queries for reports and progress (read-only).

-- name: run_operations
-- $1 operation id LIKE pattern. One row per operation with its final-transition time and output count.
SELECT o.operation_id,
       o.state::text AS state,
       o.reason,
       floor(extract(epoch FROM o.accepted_at) * 1000)::bigint AS accepted_at_ms,
       (SELECT floor(extract(epoch FROM max(t.at)) * 1000)::bigint
        FROM transitions t WHERE t.operation_id = o.operation_id) AS final_at_ms,
       (SELECT count(*) FROM outputs u WHERE u.operation_id = o.operation_id)::integer AS outputs
FROM operations o
WHERE o.operation_id LIKE $1;

-- name: run_progress
-- $1 operation id LIKE pattern. state -> count, plus unpublished outbox rows.
SELECT state::text AS state, count(*)::integer AS n
FROM operations WHERE operation_id LIKE $1
GROUP BY state
UNION ALL
SELECT 'outbox_pending', count(*)::integer FROM outbox WHERE operation_id LIKE $1 AND published_at IS NULL;

-- name: try_main_job_lock
-- One main job at a time per ledger: a session-level advisory lock, held until the connection closes.
SELECT pg_try_advisory_lock(hashtext('generation-streams:main-job'));

-- name: run_transitions
-- $1 operation id LIKE pattern. The transition log of the run's operations, in order.
SELECT operation_id, from_state::text AS from_state, to_state::text AS to_state
FROM transitions
WHERE operation_id LIKE $1
ORDER BY operation_id, id;
