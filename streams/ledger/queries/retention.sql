-- Named queries of retention and erasure (loaded by streams.ledger.sql.Queries; called by streams.ledger.retention):
-- `streams purge` erases terminal operations and deletes their rows in bounded batches, keeping each one's row of
-- its id, state and times as the guard against a replay of the id (migration 0020) until `--ids-older-than` deletes
-- it (migrations 0021, 0022), `streams operations forget`
-- erases one operation's request, source and outputs and records it (table erasures, migration 0009).
-- Terminal: succeeded, failed, canceled, rejected (streams.model.states.is_terminal). The accounting rows
-- (remote_calls, remote_jobs, refunds) are never deleted.

-- name: database_role
-- The role this session logged in as (session_user: the login role, not a group role it was granted).
SELECT session_user::text;

-- name: purge_preview
-- What a purge would erase and delete now. :older_than_s (float8): terminal for longer than this, not purged yet.
-- Returns operations (deletable now), held_by_outbox (terminal and old enough, but with an outbox row not yet
-- published: kept until the relay publishes it), oldest_age_s (seconds in its terminal state of the oldest
-- deletable one; NULL when none), transitions, outputs, outbox (the rows that would go with them).
WITH old AS (
    SELECT o.operation_id, o.state_entered_at,
           EXISTS (SELECT 1 FROM outbox b WHERE b.operation_id = o.operation_id AND b.published_at IS NULL) AS held
    FROM operations o
    WHERE o.state IN ('succeeded', 'failed', 'canceled', 'rejected')
      AND o.state_entered_at < now() - make_interval(secs => :older_than_s::float8)
      AND o.purged_at IS NULL
), doomed AS (
    SELECT operation_id, state_entered_at FROM old WHERE NOT held
)
SELECT (SELECT count(*) FROM doomed)::bigint AS operations,
       (SELECT count(*) FROM old WHERE held)::bigint AS held_by_outbox,
       (SELECT extract(epoch FROM now() - min(state_entered_at))::float8 FROM doomed) AS oldest_age_s,
       (SELECT count(*) FROM transitions t JOIN doomed d USING (operation_id))::bigint AS transitions,
       (SELECT count(*) FROM outputs x JOIN doomed d USING (operation_id))::bigint AS outputs,
       (SELECT count(*) FROM outbox b JOIN doomed d USING (operation_id))::bigint AS outbox;

-- name: purge_batch
-- Purge at most :batch_size terminal operations older than :older_than_s (float8 s in their terminal state) and not
-- purged yet, oldest first, in one statement (one transaction): their transitions, outputs, outbox rows and callback
-- deliveries deleted; their row kept, its request (JSON null), source, last observation and reason (its text; the
-- reason_code stays) erased and purged_at set: the id stays taken, so a replay of its submission is refused as for
-- a forgotten operation, never accepted again and POSTed a second time. Operations with an unpublished outbox row
-- are skipped, as are rows another transaction holds (SKIP LOCKED).
-- Returns operations (erased), transitions, outputs, outbox (deleted).
WITH doomed AS (
    SELECT o.operation_id
    FROM operations o
    WHERE o.state IN ('succeeded', 'failed', 'canceled', 'rejected')
      AND o.state_entered_at < now() - make_interval(secs => :older_than_s::float8)
      AND o.purged_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM outbox b WHERE b.operation_id = o.operation_id AND b.published_at IS NULL)
    ORDER BY o.state_entered_at, o.operation_id
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
), box AS (
    DELETE FROM outbox b USING doomed d WHERE b.operation_id = d.operation_id RETURNING 1
), outs AS (
    DELETE FROM outputs x USING doomed d WHERE x.operation_id = d.operation_id RETURNING 1
), log AS (
    DELETE FROM transitions t USING doomed d WHERE t.operation_id = d.operation_id RETURNING 1
), hints AS (  -- the record of the operations' completion callbacks (docs/callbacks.md) goes with them
    DELETE FROM callback_deliveries c USING doomed d WHERE c.operation_id = d.operation_id RETURNING 1
), ops AS (
    UPDATE operations o
    SET request = 'null'::json, source = NULL, last_observation = NULL, purged_at = now(), updated_by = session_user,
        reason = CASE WHEN o.reason IS NOT NULL THEN 'erased by streams purge' END  -- reason_code stays
    FROM doomed d WHERE o.operation_id = d.operation_id RETURNING 1
)
SELECT (SELECT count(*) FROM ops)::bigint AS operations,
       (SELECT count(*) FROM log)::bigint AS transitions,
       (SELECT count(*) FROM outs)::bigint AS outputs,
       (SELECT count(*) FROM box)::bigint AS outbox;

-- name: forget_ids_preview
-- What forget_ids_batch would delete now (the same rows). :older_than_s (float8): purged, and last replayed, longer
-- ago than this. Returns ids (kept rows deletable now), oldest_age_s (seconds since the oldest of them was purged or
-- last replayed; NULL when none), callback_deliveries, cancellations (rows deleted with them).
WITH doomed AS (
    SELECT o.operation_id, greatest(o.purged_at, o.replayed_at) AS kept_since
    FROM operations o
    WHERE o.purged_at IS NOT NULL
      AND greatest(o.purged_at, o.replayed_at) < now() - make_interval(secs => :older_than_s::float8)
      AND NOT EXISTS (SELECT 1 FROM remote_jobs j
                      WHERE j.operation_id = o.operation_id AND j.learned_via = 'created_after_decision')
      AND NOT EXISTS (SELECT 1 FROM transitions t WHERE t.operation_id = o.operation_id)
      AND NOT EXISTS (SELECT 1 FROM outputs x WHERE x.operation_id = o.operation_id)
      AND NOT EXISTS (SELECT 1 FROM outbox b WHERE b.operation_id = o.operation_id)
)
SELECT (SELECT count(*) FROM doomed)::bigint AS ids,
       (SELECT extract(epoch FROM now() - min(kept_since))::float8 FROM doomed) AS oldest_age_s,
       (SELECT count(*) FROM callback_deliveries c JOIN doomed d USING (operation_id))::bigint AS callback_deliveries,
       (SELECT count(*) FROM cancellations c JOIN doomed d USING (operation_id))::bigint AS cancellations;

-- name: forget_ids_batch
-- Delete at most :batch_size kept rows of operations purged, and last replayed (replayed_at, migration 0021), longer
-- ago than :older_than_s (float8 s), oldest first, in one statement, with what else holds their ids: the callback
-- deliveries recorded since the purge and a cancellation (which would cancel a new operation of the id before its
-- POST). The ids are free again: a submission with one of them is accepted as a new operation (the caller checks that
-- no replay can come: streams purge --ids-older-than). Kept: a row with a job the provider created after its decision
-- (observed or not: the late-job listings, the accounting and `adopt` find such a job by operation id, and would
-- offer it to a new operation of the id), a row that still has transitions, outputs or outbox rows (never, after a
-- purge: a batch would fail on their foreign keys), and rows another transaction holds (SKIP LOCKED: a late job
-- adopted changes the row's state, and its trigger clears purged_at).
-- Returns ids, callback_deliveries, cancellations (deleted).
WITH doomed AS (
    SELECT o.operation_id
    FROM operations o
    WHERE o.purged_at IS NOT NULL
      AND greatest(o.purged_at, o.replayed_at) < now() - make_interval(secs => :older_than_s::float8)
      AND NOT EXISTS (SELECT 1 FROM remote_jobs j
                      WHERE j.operation_id = o.operation_id AND j.learned_via = 'created_after_decision')
      AND NOT EXISTS (SELECT 1 FROM transitions t WHERE t.operation_id = o.operation_id)
      AND NOT EXISTS (SELECT 1 FROM outputs x WHERE x.operation_id = o.operation_id)
      AND NOT EXISTS (SELECT 1 FROM outbox b WHERE b.operation_id = o.operation_id)
    ORDER BY greatest(o.purged_at, o.replayed_at), o.operation_id
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
), hints AS (
    DELETE FROM callback_deliveries c USING doomed d WHERE c.operation_id = d.operation_id RETURNING 1
), cancels AS (
    DELETE FROM cancellations c USING doomed d WHERE c.operation_id = d.operation_id RETURNING 1
), ids AS (
    DELETE FROM operations o USING doomed d WHERE o.operation_id = d.operation_id RETURNING 1
)
SELECT (SELECT count(*) FROM ids)::bigint AS ids,
       (SELECT count(*) FROM hints)::bigint AS callback_deliveries,
       (SELECT count(*) FROM cancels)::bigint AS cancellations;

-- name: lock_for_erasure
-- :operation_id. One row or none, the operation locked (FOR UPDATE) for the rest of the transaction: state,
-- purged_at (when streams purge erased it; NULL while whole), and unpublished (its outbox rows not yet published).
SELECT o.state::text AS state, o.purged_at,
       (SELECT count(*) FROM outbox b WHERE b.operation_id = o.operation_id AND b.published_at IS NULL)::bigint
           AS unpublished
FROM operations o
WHERE o.operation_id = :operation_id
FOR UPDATE;

-- name: erase_operation!
-- Erase the request body (JSON null), the source and the last observation (which may hold outputs) of the
-- operation; updated_by names who erased. :operation_id, :actor. Returns the status line.
UPDATE operations
SET request = 'null'::json, source = NULL, last_observation = NULL, updated_by = :actor
WHERE operation_id = :operation_id;

-- name: erase_outputs
-- Erase the payload of every output of the operation (JSON null) and the output carried by their outbox rows
-- (published ones: the caller refuses while one is not). :operation_id. Returns outputs, the outputs erased.
WITH outs AS (
    UPDATE outputs SET payload = 'null'::jsonb WHERE operation_id = :operation_id RETURNING 1
), box AS (
    UPDATE outbox SET payload = jsonb_set(payload, '{output}', 'null'::jsonb)
    WHERE operation_id = :operation_id AND topic_role = 'outputs_delivered'
    RETURNING 1
)
SELECT (SELECT count(*) FROM outs)::integer AS outputs, (SELECT count(*) FROM box)::integer AS outbox;

-- name: record_erasure
-- :operation_id, :reason, :actor, :outputs_erased (integer). Returns id, at.
INSERT INTO erasures (operation_id, reason, actor, outputs_erased)
VALUES (:operation_id, :reason, :actor, :outputs_erased)
RETURNING id, at;

-- name: erasures_of
-- :operation_id. The erasures recorded for the operation, oldest first: id, reason, actor, outputs_erased, at.
SELECT id, reason, actor, outputs_erased, at FROM erasures WHERE operation_id = :operation_id ORDER BY id;
