-- Named queries of the reconciler: uncertain operations looked up at the provider by the client reference their
-- POST carried (loaded by streams.ledger.sql.Queries; called by streams.ledger.store.Ledger). The reconciler never POSTs.
--
-- A lookup is claimed like a poll (FOR UPDATE SKIP LOCKED, next_lookup_at moved one visibility timeout out, so a
-- claim lost with a dead worker comes back) and fenced like an observation (a new fencing value; every save
-- names it and touches nothing if a newer claim or an operator's decision happened since).

-- name: claim_due_lookups
-- Uncertain operations due for a lookup: never looked up and uncertain for at least :lag_s seconds (the provider's
-- consistency lag: a job created by the POST is listed by then), or rescheduled to now. Each gets a new fencing
-- value and next_lookup_at = now + :visibility_timeout_s.
-- :batch_size, :lag_s lag (s), :visibility_timeout_s visibility timeout (s), :worker. Returns operation_id, fencing_token,
-- uncertain_for_s, lookup_count (this one included), accepted_at_ms (epoch ms), former_job_ids (the jobs the accounting
-- learned for this id before the operation was accepted: a former operation's, whose id streams purge --ids-older-than
-- freed; never NULL), had_former (the accounting holds calls of the id from before: a former operation was sent).
UPDATE operations AS o
SET fencing_token = o.fencing_token + 1,
    next_lookup_at = now() + make_interval(secs => :visibility_timeout_s),
    lookup_count = o.lookup_count + 1,
    updated_by = :worker
FROM (SELECT operation_id FROM operations
      WHERE state = 'uncertain' AND lookup_gave_up_at IS NULL
        AND COALESCE(next_lookup_at, state_entered_at + make_interval(secs => :lag_s)) <= now()
      ORDER BY COALESCE(next_lookup_at, state_entered_at) LIMIT :batch_size FOR UPDATE SKIP LOCKED) AS due
WHERE o.operation_id = due.operation_id
RETURNING o.operation_id, o.fencing_token, o.lookup_count,
          extract(epoch FROM now() - o.state_entered_at)::float8 AS uncertain_for_s,
          (extract(epoch FROM o.accepted_at) * 1000)::bigint AS accepted_at_ms,
          ARRAY(SELECT j.remote_job_id FROM remote_jobs j
                WHERE j.operation_id = o.operation_id AND j.learned_at < o.accepted_at) AS former_job_ids,
          EXISTS (SELECT 1 FROM remote_calls c
                  WHERE c.operation_id = o.operation_id AND c.at < o.accepted_at) AS had_former;

-- name: adopt_found_job
-- Fenced: the lookup found jobs for this operation. The first by creation time is adopted (uncertain ->
-- submitted, observed from now on); every job found gets its accounting record: the adopted one 'lookup', the
-- others 'duplicate' (the provider created them and may charge for them). The first poll is due now when a
-- cancellation is recorded (the observer then calls the cancel route). Accounting records are written even
-- if the adoption is refused (a newer claim or an operator decided meanwhile): the jobs exist all the same.
-- :operation_id, :fencing_token, :remote_job_id adopted remote_job_id, :reason, :first_poll_delay_s first poll delay (s),
-- :jobs_found (jsonb array of {job_id, status}, oldest first; the first is :remote_job_id), :worker.
-- Returns adopted (boolean: the transition was written).
WITH adopted AS (
    UPDATE operations
    SET state = 'submitted',
        remote_job_id = :remote_job_id,
        reason = :reason,
        reason_code = 'adopted_by_lookup',
        next_poll_at = CASE WHEN EXISTS (SELECT 1 FROM cancellations c WHERE c.operation_id = :operation_id)
                            THEN now() ELSE now() + make_interval(secs => :first_poll_delay_s) END,
        next_lookup_at = NULL,
        updated_by = :worker
    WHERE operation_id = :operation_id AND fencing_token = :fencing_token AND state = 'uncertain' AND remote_job_id IS NULL
    RETURNING operation_id
), account AS (
    INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by, last_status)
    SELECT x.job_id, :operation_id,
           CASE WHEN x.job_id = :remote_job_id THEN 'lookup' ELSE 'duplicate' END,
           :worker, left(x.status, 80)
    FROM jsonb_to_recordset(:jobs_found::jsonb) AS x(job_id text, status text)
    ON CONFLICT (remote_job_id) DO NOTHING
)
SELECT EXISTS (SELECT 1 FROM adopted) AS adopted;

-- name: give_up_lookup
-- Fenced: the lookup found no job after the lag: the operation stays uncertain, left for a person, with the
-- reason :reason (the reason it became uncertain is kept after it); no further lookup.
-- :operation_id, :fencing_token, :reason, :worker. Returns operation_id, or no row when refused.
UPDATE operations
SET lookup_gave_up_at = now(),
    next_lookup_at = NULL,
    reason = left(:reason || '; became uncertain: ' || reason, 2000),
    reason_code = 'not_found_by_lookup',
    updated_by = :worker
WHERE operation_id = :operation_id AND fencing_token = :fencing_token AND state = 'uncertain'
RETURNING operation_id;

-- name: reschedule_lookup
-- Fenced: the lookup failed (outage, rate limit, refusal); try again :delay_s seconds from now.
-- :operation_id, :fencing_token, :delay_s delay (s). Returns operation_id, or no row when refused.
UPDATE operations
SET next_lookup_at = now() + make_interval(secs => :delay_s)
WHERE operation_id = :operation_id AND fencing_token = :fencing_token AND state = 'uncertain'
RETURNING operation_id;
