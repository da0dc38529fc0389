-- Named queries of completion callbacks (docs/callbacks.md). Loaded by streams.ledger.sql.Queries (aiosql).

-- name: note_callback
-- One verified callback delivery for the job :remote_job_id: recorded once by its :webhook_id and, when the job's
-- operation is pollable and its poll neither due already nor claimed by a scheduler (poll_claimed_at: claimed, its
-- event not yet taken), its next_poll_at moves to now, so the next scheduler round of any worker claims it. Any
-- pollable operation whose poll is not due already (unclaimed) gets hinted_at stamped now: a poll claimed already gets its GET after this callback (its
-- observer's claim clears hinted_at), and a poll being observed right now (taken, its GET perhaps made before the
-- job ended) finds hinted_at at its save, which then makes the next poll due now instead of after its delay
-- (save_observation in ledger.sql). So a callback during a poll is never lost, and costs at most one extra GET.
-- Nothing else changes: the state still comes from a GET. The operation's row is locked first (the claims' order).
-- :webhook_id, :remote_job_id, :worker (who writes).
-- Returns one row: operation_id (NULL: no operation has this job id; nothing recorded), recorded (false: this
-- webhook id was recorded before, a replay), made_due (the poll moved to now by this statement), hinted
-- (hinted_at stamped: made_due, or the poll was claimed).
WITH job AS MATERIALIZED (
    SELECT operation_id, state, next_poll_at, poll_claimed_at FROM operations
    WHERE remote_job_id = :remote_job_id
    FOR NO KEY UPDATE
), recorded AS (
    INSERT INTO callback_deliveries (webhook_id, remote_job_id, operation_id, poll_made_due, received_by)
    SELECT :webhook_id, :remote_job_id, job.operation_id,
           COALESCE(job.state IN ('submitted', 'queued', 'running') AND job.poll_claimed_at IS NULL
                    AND job.next_poll_at > now(), false),
           :worker
    FROM job
    ON CONFLICT (webhook_id) DO NOTHING
    RETURNING operation_id, poll_made_due
), hinted AS (
    UPDATE operations AS o
    SET next_poll_at = CASE WHEN recorded.poll_made_due THEN now() ELSE o.next_poll_at END,
        hinted_at = now()
    FROM recorded JOIN job USING (operation_id)
    WHERE o.operation_id = recorded.operation_id AND job.state IN ('submitted', 'queued', 'running')
      AND (job.poll_claimed_at IS NOT NULL OR job.next_poll_at > now())
    RETURNING o.operation_id, recorded.poll_made_due
)
SELECT (SELECT operation_id FROM job) AS operation_id,
       EXISTS (SELECT 1 FROM recorded) AS recorded,
       EXISTS (SELECT 1 FROM hinted WHERE poll_made_due) AS made_due,
       EXISTS (SELECT 1 FROM hinted) AS hinted;
