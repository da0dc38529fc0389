-- Named queries of the benchmark's two reference programs (streams_harness/bench): the floor (the pipeline's
-- writes, batched over many operations per statement, no checks) and the naive peer (one operation per
-- statement, no lease, no fencing). Both write the ledger's own tables, so its triggers do the same work.

-- name: floor_accept_many
-- :operation_ids (text[]), :requests provider requests as JSON texts (text[]), :submitted_at_ms (bigint[]),
-- :worker. Inserts the new ones as 'accepted'.
INSERT INTO operations (operation_id, request, submitted_at_ms, updated_by)
SELECT x.operation_id, x.request::json, x.submitted_at_ms, :worker
FROM unnest(:operation_ids::text[], :requests::text[], :submitted_at_ms::bigint[]) AS x(operation_id, request, submitted_at_ms)
ON CONFLICT (operation_id) DO NOTHING;

-- name: floor_claim_submit_many
-- :operation_ids (text[]), :worker. accepted -> submitting; returns operation_id, fencing_token.
UPDATE operations
SET state = 'submitting', fencing_token = fencing_token + 1, updated_by = :worker
WHERE operation_id = ANY(:operation_ids::text[]) AND state = 'accepted'
RETURNING operation_id, fencing_token;

-- name: floor_save_submitted_many
-- :operation_ids (text[]), :remote_job_ids (text[]), :first_poll_delays_s first poll delays in s (float8[]), :worker. With
-- the jobs' accounting records, as save_submitted of the ledger does for one.
WITH saved AS (
    UPDATE operations AS o
    SET state = 'submitted', remote_job_id = x.remote_job_id,
        next_poll_at = now() + make_interval(secs => x.delay_s), updated_by = :worker
    FROM unnest(:operation_ids::text[], :remote_job_ids::text[], :first_poll_delays_s::float8[]) AS x(operation_id, remote_job_id, delay_s)
    WHERE o.operation_id = x.operation_id AND o.state = 'submitting'
    RETURNING o.operation_id, o.remote_job_id
)
INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by)
SELECT remote_job_id, operation_id, 'post_2xx', :worker FROM saved
ON CONFLICT (remote_job_id) DO NOTHING;

-- name: floor_claim_observe_many
-- :operation_ids (text[]), :poll_claim_ids (bigint[]), :worker. A new fencing value per claimed poll;
-- returns operation_id, fencing_token, remote_job_id.
UPDATE operations AS o
SET fencing_token = o.fencing_token + 1, updated_by = :worker
FROM unnest(:operation_ids::text[], :poll_claim_ids::bigint[]) AS x(operation_id, poll_claim_id)
WHERE o.operation_id = x.operation_id AND o.poll_claim_id = x.poll_claim_id
  AND o.state IN ('submitted', 'queued', 'running')
RETURNING o.operation_id, o.fencing_token, o.remote_job_id;

-- name: floor_save_observations_many
-- One statement for a batch of GET answers: the states, and for 'succeeded' the outputs and their outbox rows
-- (as save_observation of the ledger does for one). :operation_ids (text[]), :fencing_tokens (bigint[]),
-- :states (text[]), :observations as JSON texts (text[]), :next_poll_delays_s next poll delays in s (float8[], NULL when
-- terminal), :remote_completed_at_ms remote completion times in epoch ms (bigint[]), :outputs as JSON array texts (text[]),
-- :worker. Returns the number of operations saved.
WITH x AS (
    SELECT * FROM unnest(:operation_ids::text[], :fencing_tokens::bigint[], :states::text[], :observations::text[], :next_poll_delays_s::float8[], :remote_completed_at_ms::bigint[], :outputs::text[])
        AS x(operation_id, fencing_token, state, observation, delay_s, completed_ms, outputs)
), saved AS (
    UPDATE operations AS o
    SET state = x.state::operation_state,
        last_observation = x.observation::jsonb,
        last_observed_at = now(),
        poll_count = o.poll_count + 1,
        next_poll_at = CASE WHEN x.delay_s IS NULL THEN NULL ELSE now() + make_interval(secs => x.delay_s) END,
        remote_completed_at = COALESCE(to_timestamp(x.completed_ms / 1000.0), o.remote_completed_at),
        updated_by = :worker
    FROM x
    WHERE o.operation_id = x.operation_id AND o.fencing_token = x.fencing_token
    RETURNING o.operation_id, o.state, o.remote_job_id, x.outputs, x.completed_ms
), outs AS (
    INSERT INTO outputs (operation_id, output_id, position, payload)
    SELECT saved.operation_id, e.value ->> 'id', (e.ordinality - 1)::integer, e.value
    FROM saved, jsonb_array_elements(saved.outputs::jsonb) WITH ORDINALITY AS e(value, ordinality)
    WHERE saved.state = 'succeeded'
    ON CONFLICT (operation_id, output_id) DO NOTHING
    RETURNING operation_id, output_id, position, payload, recorded_at
), box AS (
    INSERT INTO outbox (event_id, topic_role, operation_id, output_id, payload)
    SELECT 'output:' || outs.operation_id || ':' || outs.output_id,
           'outputs_delivered',
           outs.operation_id,
           outs.output_id,
           jsonb_build_object(
               'event_id', 'output:' || outs.operation_id || ':' || outs.output_id,
               'operation_id', outs.operation_id,
               'output_id', outs.output_id,
               'position', outs.position,
               'remote_job_id', saved.remote_job_id,
               'output', outs.payload,
               'remote_completed_at_ms', saved.completed_ms,
               'recorded_at_ms', floor(extract(epoch FROM outs.recorded_at) * 1000)::bigint)
    FROM outs JOIN saved USING (operation_id)
    ON CONFLICT DO NOTHING
    RETURNING 1
), account AS (
    UPDATE remote_jobs AS j
    SET outcome = saved.state::text, outcome_at = now()
    FROM saved
    WHERE j.remote_job_id = saved.remote_job_id AND saved.state IN ('succeeded', 'failed', 'canceled')
)
SELECT count(*)::integer FROM saved;

-- name: floor_record_calls_many
-- Accounting for a batch of remote calls. :operation_ids (text[]), :methods (text[]), :status_codes
-- (int[]), :outcomes (text[]), :remote_job_ids (text[]), :durations_ms durations in ms (float8[]), :fencing_tokens
-- (bigint[]), :worker. POSTs that created a job also give it its accounting record (record_remote_call).
WITH x AS (
    SELECT * FROM unnest(:operation_ids::text[], :methods::text[], :status_codes::integer[], :outcomes::text[], :remote_job_ids::text[], :durations_ms::float8[], :fencing_tokens::bigint[])
        AS x(operation_id, method, status_code, outcome, remote_job_id, duration_ms, fencing_token)
), calls AS (
    INSERT INTO remote_calls (operation_id, method, status_code, outcome, remote_job_id, duration_ms,
                              fencing_token, worker)
    SELECT x.*, :worker FROM x
)
INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by)
SELECT remote_job_id, operation_id, 'post_2xx', :worker FROM x
WHERE method = 'POST' AND remote_job_id IS NOT NULL AND outcome = 'created'
ON CONFLICT (remote_job_id) DO NOTHING;

-- name: naive_mark_submitting!
-- The naive peer: no state check, no fencing value. :operation_id, :worker.
UPDATE operations SET state = 'submitting', updated_by = :worker WHERE operation_id = :operation_id;

-- name: naive_save_job!
-- :operation_id, :remote_job_id, :worker. Pollable at once.
UPDATE operations SET state = 'submitted', remote_job_id = :remote_job_id, next_poll_at = now(), updated_by = :worker
WHERE operation_id = :operation_id;

-- name: naive_pollable
-- Every job not final yet, whoever else is polling it. :limit. Returns operation_id, remote_job_id.
SELECT operation_id, remote_job_id
FROM operations
WHERE state IN ('submitted', 'queued', 'running')
ORDER BY next_poll_at
LIMIT :limit;

-- name: naive_save_state!
-- :operation_id, :state, :observation (jsonb), :remote_completed_at_ms remote completion time in epoch ms (or NULL),
-- :worker. No fencing value: the last writer wins (the ledger's trigger still refuses a step backwards).
UPDATE operations
SET state = :state::operation_state,
    last_observation = :observation::jsonb,
    last_observed_at = now(),
    poll_count = poll_count + 1,
    next_poll_at = CASE WHEN :state IN ('succeeded', 'failed', 'canceled') THEN NULL ELSE now() END,
    remote_completed_at = COALESCE(to_timestamp(:remote_completed_at_ms::bigint / 1000.0), remote_completed_at),
    updated_by = :worker
WHERE operation_id = :operation_id;

-- name: naive_save_outputs
-- :operation_id, :outputs (jsonb array). Returns output_id, position, payload (text) of each.
INSERT INTO outputs (operation_id, output_id, position, payload)
SELECT :operation_id, e.value ->> 'id', (e.ordinality - 1)::integer, e.value
FROM jsonb_array_elements(:outputs::jsonb) WITH ORDINALITY AS e(value, ordinality)
ON CONFLICT (operation_id, output_id) DO UPDATE SET payload = EXCLUDED.payload
RETURNING output_id, position, payload::text AS payload;

-- name: peer_request
-- The job-queue peer: the request of :operation_id as the provider's JSON text.
SELECT request::text FROM operations WHERE operation_id = :operation_id;

-- name: peer_save_outputs_once
-- The job-queue peer: :operation_id, :outputs (jsonb array). Inserts the outputs not saved yet and returns
-- output_id, position, payload (text) of those only (none when another run of the job saved them first).
INSERT INTO outputs (operation_id, output_id, position, payload)
SELECT :operation_id, e.value ->> 'id', (e.ordinality - 1)::integer, e.value
FROM jsonb_array_elements(:outputs::jsonb) WITH ORDINALITY AS e(value, ordinality)
ON CONFLICT (operation_id, output_id) DO NOTHING
RETURNING output_id, position, payload::text AS payload;

-- name: database_transactions
-- :database (its name). Transactions committed and rolled back in it since the statistics were last reset: one
-- per statement run outside an explicit transaction (and one per statement prepared), one per BEGIN..COMMIT.
SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database WHERE datname = :database;

-- name: database_backends
-- :databases (text array of names). Returns pid of each backend connected to one of them (the caller's own
-- connection excluded).
SELECT pid FROM pg_stat_activity WHERE datname = ANY(:databases::text[]) AND pid <> pg_backend_pid();

-- name: create_statement_statistics!
-- The pg_stat_statements extension in the connected database (a run's own, which the benchmark created), so that
-- its view reads there. Needs the module in shared_preload_libraries to read anything, and a superuser (the
-- extension is not trusted).
CREATE EXTENSION IF NOT EXISTS pg_stat_statements;

-- name: statement_statistics
-- :databases (text array of names). Returns a row per top-level statement run in those databases since the
-- statistics were reset (PostgreSQL 14 or later), summed over the roles that ran it: queryid, query (PostgreSQL's
-- text of it, its constants replaced by $n), calls, exec_ms (execution time, ms), rows; each row also holds the
-- view's dealloc (entries evicted so far) and stats_reset; one row with a NULL queryid when there is no statement.
SELECT s.queryid, s.query, s.calls, s.exec_ms, s.rows, i.dealloc, i.stats_reset
FROM pg_stat_statements_info AS i
LEFT JOIN (
    SELECT p.queryid, min(p.query) AS query, sum(p.calls)::bigint AS calls,
           sum(p.total_exec_time)::float8 AS exec_ms, sum(p.rows)::bigint AS rows
    FROM pg_stat_statements AS p JOIN pg_database AS d ON d.oid = p.dbid
    WHERE d.datname = ANY(:databases::text[]) AND p.toplevel
    GROUP BY p.queryid
) AS s ON true;
