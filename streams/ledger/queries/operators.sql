-- Named queries of the operators' decisions (loaded by streams.ledger.sql.Queries; called by streams.ledger.store.Ledger).
--
-- Each is one fenced statement: it takes a new fencing value (any worker still holding an older one is refused
-- from then on), moves the state only from the one state the decision applies to, and writes the operator's
-- name into updated_by, which the transition log records with the reason. No row when the operation is not in
-- that state (or does not exist); the caller reads the operation to say which.

-- name: adopt
-- uncertain -> submitted with the job id an operator found at the provider; the job is observed from now on
-- and gets its accounting record ('adopted', unless the system already knew the job).
-- :operation_id, :remote_job_id, :reason, :actor. Returns transition_seq, fencing_token.
WITH adopted AS (
    UPDATE operations
    SET state = 'submitted',
        remote_job_id = :remote_job_id,
        reason = :reason,
        reason_code = 'adopted_by_operator',
        fencing_token = fencing_token + 1,
        next_poll_at = now(),
        next_lookup_at = NULL,
        updated_by = :actor
    WHERE operation_id = :operation_id AND state = 'uncertain' AND remote_job_id IS NULL
    RETURNING operation_id, remote_job_id, transition_seq, fencing_token
), account AS (
    INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by)
    SELECT remote_job_id, operation_id, 'adopted', :actor FROM adopted
    ON CONFLICT (remote_job_id) DO NOTHING
)
SELECT transition_seq, fencing_token FROM adopted;

-- name: abandon
-- uncertain -> rejected: an operator checked that the provider created no job for this operation.
-- :operation_id, :reason, :actor. Returns transition_seq, fencing_token.
UPDATE operations
SET state = 'rejected',
    reason = :reason,
    reason_code = 'abandoned_by_operator',
    fencing_token = fencing_token + 1,
    next_lookup_at = NULL,
    updated_by = :actor
WHERE operation_id = :operation_id AND state = 'uncertain'
RETURNING transition_seq, fencing_token;

-- name: repoll
-- stalled -> submitted: observe the same job again, due now, with a fresh observation window (maximum age and
-- unknown-status and failed-poll counts start over; the 404 grace window still counts from when the job id was saved).
-- :operation_id, :reason, :actor. Returns transition_seq, fencing_token.
UPDATE operations
SET state = 'submitted',
    reason = :reason,
    reason_code = 'repolled_by_operator',
    fencing_token = fencing_token + 1,
    next_poll_at = now(),
    observing_since = now(),
    unknown_status_count = 0,
    failed_poll_count = 0,
    updated_by = :actor
WHERE operation_id = :operation_id AND state = 'stalled'
RETURNING transition_seq, fencing_token;

-- name: fail_stalled
-- stalled -> failed, an operator's decision (the provider never said so: the job's accounting outcome stays
-- unknown).
-- :operation_id, :reason, :actor. Returns transition_seq, fencing_token.
UPDATE operations
SET state = 'failed',
    reason = :reason,
    reason_code = 'failed_by_operator',
    fencing_token = fencing_token + 1,
    updated_by = :actor
WHERE operation_id = :operation_id AND state = 'stalled'
RETURNING transition_seq, fencing_token;

-- name: operation_holding_job
-- :remote_job_id. The operation that saved this job id, if any.
SELECT operation_id FROM operations WHERE remote_job_id = :remote_job_id;

-- name: former_job_of_operation
-- :operation_id, :remote_job_id. 1 when the accounting learned this job for the id before the operation holding the
-- id now was accepted: a former operation's of the same id (streams purge --ids-older-than freed it), never this
-- one's; no row otherwise.
SELECT 1 FROM remote_jobs j JOIN operations o USING (operation_id)
WHERE j.remote_job_id = :remote_job_id AND j.operation_id = :operation_id AND j.learned_at < o.accepted_at;

-- name: adopt_late_job
-- rejected -> submitted with the job a POST answer reported after the operation was decided (the accounting
-- holds it for this operation as 'created_after_decision'; the trigger operations_late_job_guard refuses any
-- other job): the job is observed from now on.
-- :operation_id, :remote_job_id, :reason, :actor. Returns transition_seq, fencing_token.
UPDATE operations AS o
SET state = 'submitted',
    remote_job_id = :remote_job_id,
    reason = :reason,
    reason_code = 'adopted_after_decision',
    fencing_token = o.fencing_token + 1,
    next_poll_at = now(),
    next_lookup_at = NULL,
    updated_by = :actor
WHERE o.operation_id = :operation_id AND o.state = 'rejected' AND o.remote_job_id IS NULL
  AND EXISTS (SELECT 1 FROM remote_jobs j
              WHERE j.remote_job_id = :remote_job_id AND j.operation_id = o.operation_id
                AND j.learned_via = 'created_after_decision')
RETURNING o.transition_seq, o.fencing_token;

-- name: late_jobs_of_operation
-- :operation_id. The jobs created after a decision on this operation and not observed for it, oldest first:
-- remote_job_id.
SELECT j.remote_job_id
FROM remote_jobs j JOIN operations o USING (operation_id)
WHERE j.operation_id = :operation_id AND j.learned_via = 'created_after_decision'
  AND o.remote_job_id IS DISTINCT FROM j.remote_job_id
ORDER BY j.learned_at, j.remote_job_id;
