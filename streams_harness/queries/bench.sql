-- Named queries of the benchmark's two reference programs (streams_harness/bench): the floor (the pipeline's
-- writes, batched over many operations per statement, no checks) and the naive peer (one operation per
-- statement, no lease, no fencing). Both write the ledger's own tables, so its triggers do the same work.

-- name: floor_accept_many
-- $1 operation ids (text[]), $2 provider requests as JSON texts (text[]), $3 submitted_at_ms (bigint[]),
-- $4 worker. Inserts the new ones as 'accepted'.
INSERT INTO operations (operation_id, request, submitted_at_ms, updated_by)
SELECT x.operation_id, x.request::json, x.submitted_at_ms, $4
FROM unnest($1::text[], $2::text[], $3::bigint[]) AS x(operation_id, request, submitted_at_ms)
ON CONFLICT (operation_id) DO NOTHING;

-- name: floor_claim_submit_many
-- $1 operation ids (text[]), $2 worker. accepted -> submitting; returns operation_id, fencing_token.
UPDATE operations
SET state = 'submitting', fencing_token = fencing_token + 1, updated_by = $2
WHERE operation_id = ANY($1::text[]) AND state = 'accepted'
RETURNING operation_id, fencing_token;

-- name: floor_save_submitted_many
-- $1 operation ids (text[]), $2 remote job ids (text[]), $3 first poll delays in s (float8[]), $4 worker. With
-- the jobs' accounting records, as save_submitted of the ledger does for one.
WITH saved AS (
    UPDATE operations AS o
    SET state = 'submitted', remote_job_id = x.remote_job_id,
        next_poll_at = now() + make_interval(secs => x.delay_s), updated_by = $4
    FROM unnest($1::text[], $2::text[], $3::float8[]) AS x(operation_id, remote_job_id, delay_s)
    WHERE o.operation_id = x.operation_id AND o.state = 'submitting'
    RETURNING o.operation_id, o.remote_job_id
)
INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by)
SELECT remote_job_id, operation_id, 'post_2xx', $4 FROM saved
ON CONFLICT (remote_job_id) DO NOTHING;

-- name: floor_claim_observe_many
-- $1 operation ids (text[]), $2 poll claim ids (bigint[]), $3 worker. A new fencing value per claimed poll;
-- returns operation_id, fencing_token, remote_job_id.
UPDATE operations AS o
SET fencing_token = o.fencing_token + 1, updated_by = $3
FROM unnest($1::text[], $2::bigint[]) AS x(operation_id, poll_claim_id)
WHERE o.operation_id = x.operation_id AND o.poll_claim_id = x.poll_claim_id
  AND o.state IN ('submitted', 'queued', 'running')
RETURNING o.operation_id, o.fencing_token, o.remote_job_id;

-- name: floor_save_observations_many
-- One statement for a batch of GET answers: the states, and for 'succeeded' the outputs and their outbox rows
-- (as save_observation of the ledger does for one). $1 operation ids (text[]), $2 fencing tokens (bigint[]),
-- $3 states (text[]), $4 observations as JSON texts (text[]), $5 next poll delays in s (float8[], NULL when
-- terminal), $6 remote completion times in epoch ms (bigint[]), $7 outputs as JSON array texts (text[]),
-- $8 worker. Returns the number of operations saved.
WITH x AS (
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::float8[], $6::bigint[], $7::text[])
        AS x(operation_id, fencing_token, state, observation, delay_s, completed_ms, outputs)
), saved AS (
    UPDATE operations AS o
    SET state = x.state::operation_state,
        last_observation = x.observation::jsonb,
        last_observed_at = now(),
        poll_count = o.poll_count + 1,
        next_poll_at = CASE WHEN x.delay_s IS NULL THEN NULL ELSE now() + make_interval(secs => x.delay_s) END,
        remote_completed_at = COALESCE(to_timestamp(x.completed_ms / 1000.0), o.remote_completed_at),
        updated_by = $8
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
-- Accounting for a batch of remote calls. $1 operation ids (text[]), $2 methods (text[]), $3 status codes
-- (int[]), $4 outcomes (text[]), $5 remote job ids (text[]), $6 durations in ms (float8[]), $7 fencing tokens
-- (bigint[]), $8 worker. POSTs that created a job also give it its accounting record (record_remote_call).
WITH x AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::integer[], $4::text[], $5::text[], $6::float8[], $7::bigint[])
        AS x(operation_id, method, status_code, outcome, remote_job_id, duration_ms, fencing_token)
), calls AS (
    INSERT INTO remote_calls (operation_id, method, status_code, outcome, remote_job_id, duration_ms,
                              fencing_token, worker)
    SELECT x.*, $8 FROM x
)
INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by)
SELECT remote_job_id, operation_id, 'post_2xx', $8 FROM x
WHERE method = 'POST' AND remote_job_id IS NOT NULL AND outcome = 'created'
ON CONFLICT (remote_job_id) DO NOTHING;

-- name: naive_mark_submitting
-- The naive peer: no state check, no fencing value. $1 operation_id, $2 worker.
UPDATE operations SET state = 'submitting', updated_by = $2 WHERE operation_id = $1;

-- name: naive_save_job
-- $1 operation_id, $2 remote job id, $3 worker. Pollable at once.
UPDATE operations SET state = 'submitted', remote_job_id = $2, next_poll_at = now(), updated_by = $3
WHERE operation_id = $1;

-- name: naive_pollable
-- Every job not final yet, whoever else is polling it. $1 limit. Returns operation_id, remote_job_id.
SELECT operation_id, remote_job_id
FROM operations
WHERE state IN ('submitted', 'queued', 'running')
ORDER BY next_poll_at
LIMIT $1;

-- name: naive_save_state
-- $1 operation_id, $2 state, $3 observation (jsonb), $4 remote completion time in epoch ms (or NULL),
-- $5 worker. No fencing value: the last writer wins (the ledger's trigger still refuses a step backwards).
UPDATE operations
SET state = $2::operation_state,
    last_observation = $3::jsonb,
    last_observed_at = now(),
    poll_count = poll_count + 1,
    next_poll_at = CASE WHEN $2 IN ('succeeded', 'failed', 'canceled') THEN NULL ELSE now() END,
    remote_completed_at = COALESCE(to_timestamp($4::bigint / 1000.0), remote_completed_at),
    updated_by = $5
WHERE operation_id = $1;

-- name: naive_save_outputs
-- $1 operation_id, $2 outputs (jsonb array). Returns output_id, position, payload (text) of each.
INSERT INTO outputs (operation_id, output_id, position, payload)
SELECT $1, e.value ->> 'id', (e.ordinality - 1)::integer, e.value
FROM jsonb_array_elements($2::jsonb) WITH ORDINALITY AS e(value, ordinality)
ON CONFLICT (operation_id, output_id) DO UPDATE SET payload = EXCLUDED.payload
RETURNING output_id, position, payload::text AS payload;

-- name: database_transactions
-- $1 database name. Transactions committed and rolled back in it since the statistics were last reset: one
-- per statement run outside an explicit transaction (and one per statement prepared), one per BEGIN..COMMIT.
SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database WHERE datname = $1;
