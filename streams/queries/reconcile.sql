-- Named queries of the reconciler: uncertain operations looked up at the provider by the client reference their
-- POST carried (loaded by streams.sql.Queries; called by streams.ledger.Ledger). The reconciler never POSTs.
--
-- A lookup is claimed like a poll (FOR UPDATE SKIP LOCKED, next_lookup_at moved one visibility timeout out, so a
-- claim lost with a dead worker comes back) and fenced like an observation (a new fencing value; every save
-- names it and touches nothing if a newer claim or an operator's decision happened since).

-- name: claim_due_lookups
-- Uncertain operations due for a lookup: never looked up and uncertain for at least $2 seconds (the provider's
-- consistency lag: a job created by the POST is listed by then), or rescheduled to now. Each gets a new fencing
-- value and next_lookup_at = now + $3.
-- $1 batch size, $2 lag (s), $3 visibility timeout (s), $4 worker. Returns operation_id, fencing_token,
-- uncertain_for_s, lookup_count (this one included).
UPDATE operations AS o
SET fencing_token = o.fencing_token + 1,
    next_lookup_at = now() + make_interval(secs => $3),
    lookup_count = o.lookup_count + 1,
    updated_by = $4
FROM (SELECT operation_id FROM operations
      WHERE state = 'uncertain' AND lookup_gave_up_at IS NULL
        AND COALESCE(next_lookup_at, state_entered_at + make_interval(secs => $2)) <= now()
      ORDER BY COALESCE(next_lookup_at, state_entered_at) LIMIT $1 FOR UPDATE SKIP LOCKED) AS due
WHERE o.operation_id = due.operation_id
RETURNING o.operation_id, o.fencing_token, o.lookup_count,
          extract(epoch FROM now() - o.state_entered_at)::float8 AS uncertain_for_s;

-- name: adopt_found_job
-- Fenced: the lookup found jobs for this operation. The first by creation time is adopted (uncertain ->
-- submitted, observed from now on); every job found gets its accounting record: the adopted one 'lookup', the
-- others 'duplicate' (the provider created them and may charge for them). Accounting records are written even
-- if the adoption is refused (a newer claim or an operator decided meanwhile): the jobs exist all the same.
-- $1 operation_id, $2 fencing_token, $3 adopted remote_job_id, $4 reason, $5 first poll delay (s),
-- $6 jobs found (jsonb array of {job_id, status}, oldest first; the first is $3), $7 worker.
-- Returns adopted (boolean: the transition was written).
WITH adopted AS (
    UPDATE operations
    SET state = 'submitted',
        remote_job_id = $3,
        reason = $4,
        reason_code = 'adopted_by_lookup',
        next_poll_at = now() + make_interval(secs => $5),
        next_lookup_at = NULL,
        updated_by = $7
    WHERE operation_id = $1 AND fencing_token = $2 AND state = 'uncertain' AND remote_job_id IS NULL
    RETURNING operation_id
), account AS (
    INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by, last_status)
    SELECT x.job_id, $1,
           CASE WHEN x.job_id = $3 THEN 'lookup' ELSE 'duplicate' END,
           $7, left(x.status, 80)
    FROM jsonb_to_recordset($6::jsonb) AS x(job_id text, status text)
    ON CONFLICT (remote_job_id) DO NOTHING
)
SELECT EXISTS (SELECT 1 FROM adopted) AS adopted;

-- name: give_up_lookup
-- Fenced: the lookup found no job after the lag: the operation stays uncertain, left for a person, with the
-- reason $3 (the reason it became uncertain is kept after it); no further lookup.
-- $1 operation_id, $2 fencing_token, $3 reason, $4 worker. Returns operation_id, or no row when refused.
UPDATE operations
SET lookup_gave_up_at = now(),
    next_lookup_at = NULL,
    reason = left($3 || '; became uncertain: ' || reason, 2000),
    reason_code = 'not_found_by_lookup',
    updated_by = $4
WHERE operation_id = $1 AND fencing_token = $2 AND state = 'uncertain'
RETURNING operation_id;

-- name: reschedule_lookup
-- Fenced: the lookup failed (outage, rate limit, refusal); try again $3 seconds from now.
-- $1 operation_id, $2 fencing_token, $3 delay (s). Returns operation_id, or no row when refused.
UPDATE operations
SET next_lookup_at = now() + make_interval(secs => $3)
WHERE operation_id = $1 AND fencing_token = $2 AND state = 'uncertain'
RETURNING operation_id;
