-- Named queries of cancellation (docs/cancellation.md). Loaded by streams.ledger.sql.Queries (aiosql).
--
-- Ordering: a cancellation and the dispatcher's claim (ledger.sql claim_for_submit) meet on the operation's row
-- lock. A cancel that locks the row first moves an 'accepted' operation to 'canceled' (the claim then finds it past
-- 'accepted': no POST); a claim that locks it first wins ('submitting': the POST goes out and the job is canceled
-- at the provider once its id is saved). A cancel recorded before its operation exists is found by the claim,
-- which ends the operation 'canceled' instead of 'submitting'.

-- name: request_cancel
-- Record that cancellation was asked (the first ask per operation; a repeat records nothing) and, when the
-- operation is still 'accepted', end it 'canceled' (nothing was sent); when it has a job to poll ('submitted',
-- 'queued', 'running') whose poll is neither due already nor claimed by a scheduler, its next_poll_at moves to
-- now, so the next scheduler round of any worker claims it and its observer calls the provider's cancel route
-- (as note_callback in callbacks.sql does). The operation's row is locked first.
-- :operation_id, :path ('topic' | 'operator'), :actor (who asked), :reason (why), :worker (who writes).
-- Returns one row: state_when_asked (text, NULL when the operation is not in the ledger), recorded (this ask was
-- written), canceled_now (accepted -> canceled by this statement), poll_made_due (the poll moved to now by this
-- statement).
WITH locked AS MATERIALIZED (
    SELECT operation_id, state, next_poll_at, poll_claimed_at FROM operations
    WHERE operation_id = :operation_id FOR UPDATE
), asked AS (
    INSERT INTO cancellations (operation_id, path, actor, reason, state_when_asked)
    VALUES (:operation_id, :path, :actor, :reason, (SELECT state FROM locked))
    ON CONFLICT (operation_id) DO NOTHING
    RETURNING operation_id
), replayed AS (  -- a cancel of an erased operation (forgotten or purged) keeps its id taken until its copy on
    -- the topic is gone: streams purge --ids-older-than counts from replayed_at (migration 0021), as for a resend
    UPDATE operations AS o
    SET replayed_at = now()
    FROM locked
    WHERE o.operation_id = locked.operation_id AND o.request::text = 'null'
    RETURNING o.operation_id
), canceled AS (
    UPDATE operations AS o
    SET state = 'canceled',
        reason = 'canceled before submit (asked by ' || :path || '): ' || :reason,
        reason_code = 'canceled_before_submit',
        updated_by = :worker
    FROM locked
    WHERE o.operation_id = locked.operation_id AND locked.state = 'accepted'
    RETURNING o.operation_id
), due AS (
    UPDATE operations AS o
    SET next_poll_at = now()
    FROM locked
    WHERE o.operation_id = locked.operation_id AND EXISTS (SELECT 1 FROM asked)
      AND locked.state IN ('submitted', 'queued', 'running')
      AND locked.poll_claimed_at IS NULL AND locked.next_poll_at > now()
    RETURNING o.operation_id
)
SELECT (SELECT state::text FROM locked) AS state_when_asked,
       EXISTS (SELECT 1 FROM asked) AS recorded,
       EXISTS (SELECT 1 FROM canceled) AS canceled_now,
       EXISTS (SELECT 1 FROM due) AS poll_made_due;

-- name: note_cancel_call
-- Fenced: one call of the provider's cancel route for the operation's job, with its classified answer; a definite
-- answer (:answered) sets cancel_answered_at, after which the route is never called again for it.
-- :operation_id, :fencing_token, :outcome (remote_call_outcomes), :answered (boolean). Returns cancel_attempts
-- afterwards, or no row when refused (stale fencing value, or already answered).
UPDATE operations
SET cancel_attempts = cancel_attempts + 1,
    cancel_outcome = :outcome,
    cancel_answered_at = CASE WHEN :answered::boolean THEN now() END
WHERE operation_id = :operation_id AND fencing_token = :fencing_token AND cancel_answered_at IS NULL
RETURNING cancel_attempts;
