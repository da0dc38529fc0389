-- Named queries of the ledger. Each query starts with its name line; the comment lines after it document its
-- named parameters (:name) and its result. Loaded by streams.ledger.sql.Queries (aiosql).
--
-- Every query is one statement (one round trip, atomic). State changes are logged by the database itself:
-- the operations_log_transition trigger writes the transition log row and the generation.transitions
-- outbox event; operations_guard refuses illegal transitions, fencing regressions and job-id rewrites.
-- The parameter :worker fills operations.updated_by, which the transition log records.
--
-- Batched queries (streams.ledger.store coalesces the requests of concurrent tasks): one row per request, given as
-- parallel arrays read by unnest ... WITH ORDINALITY, so "i" is a request's position (from 1). The same
-- operation appears at most once per statement (the ledger sends a repeat in a later statement). Rows of
-- operations are locked first, in operation_id order (the "locked" step), so two batches over the same
-- operations, in whatever order they were given, never wait on each other in a cycle. The parameter
-- :lock_timeout bounds how long the statement waits for a lock held by another transaction (set for this
-- statement only: a batch gives up rather than hold up every request in it; '0' waits as long as it takes). A
-- JSON value travels as JSON text (text[]) and is cast in the statement. Conditions on indexed columns (state,
-- remote_job_id) are read from the "locked" row, which is the row as it stands (locked, it cannot change before
-- the update): the same test as on the updated row, but it leaves the planner no partial or state index to scan
-- in full instead of looking the batch's rows up by primary key (a cached plan made while the table looked
-- small did, reading every accepted or pollable operation for each batch).

-- name: accept_operation
-- Batched: insert new operations in state 'accepted' (idempotent: a replayed submission inserts nothing).
-- :operation_ids (text[], distinct), :requests (JSON texts, stored as they are), :submitted_at_ms
-- (bigint[]), :sources (JSON texts or NULLs), :worker, :lock_timeout. Returns operation_id, fencing_token of
-- the rows newly inserted (inserted in operation_id order).
INSERT INTO operations (operation_id, request, submitted_at_ms, source, updated_by)
SELECT r.operation_id, r.request::json, r.submitted_at_ms, r.source::json, :worker
FROM unnest(:operation_ids::text[], :requests::text[], :submitted_at_ms::bigint[], :sources::text[]) AS r(operation_id, request, submitted_at_ms, source)
WHERE (SELECT set_config('lock_timeout', :lock_timeout, true)) IS NOT NULL
ORDER BY r.operation_id
ON CONFLICT (operation_id) DO NOTHING
RETURNING operation_id, fencing_token;

-- name: claim_for_submit
-- Batched: the dispatcher's claim: accepted -> submitting, written before the POST, with a new fencing value and
-- the caller's claim id. The same claim sent again (its reply was lost after the commit) finds its claim id on the
-- row, still submitting, and gets the fencing value it wrote; nothing is written again. An operation whose
-- cancellation is recorded (cancellations.sql) goes accepted -> canceled instead, and no POST is sent for it.
-- :operation_ids (text[], distinct), :claim_ids (uuid[]), :worker, :lock_timeout. Returns i, fencing_token per
-- claimed request; none for an operation past 'accepted' by another claim, canceled (now or before), or unknown.
WITH req AS (
    SELECT * FROM unnest(:operation_ids::text[], :claim_ids::uuid[]) WITH ORDINALITY AS r(operation_id, claim_id, i)
), locked AS MATERIALIZED (
    SELECT operation_id, state, fencing_token, claim_id FROM operations
    WHERE operation_id = ANY(:operation_ids::text[]) AND (SELECT set_config('lock_timeout', :lock_timeout, true)) IS NOT NULL
    ORDER BY operation_id
    FOR NO KEY UPDATE
), asked AS (
    SELECT operation_id, path AS asked_path, reason AS asked_reason FROM cancellations
    WHERE operation_id = ANY(:operation_ids::text[])
), claimed AS (
    UPDATE operations AS o
    SET state = CASE WHEN asked.asked_path IS NULL THEN 'submitting' ELSE 'canceled' END::operation_state,
        fencing_token = o.fencing_token + 1,
        claim_id = req.claim_id,
        reason = CASE WHEN asked.asked_path IS NOT NULL
                      THEN 'canceled before submit (asked by ' || asked.asked_path || '): ' || asked.asked_reason END,
        reason_code = CASE WHEN asked.asked_path IS NOT NULL THEN 'canceled_before_submit' END,
        updated_by = :worker
    FROM req JOIN locked USING (operation_id) LEFT JOIN asked USING (operation_id)
    WHERE o.operation_id = req.operation_id AND locked.state = 'accepted'
    RETURNING req.i, o.fencing_token, o.state
)
SELECT i, fencing_token FROM claimed WHERE state = 'submitting'
UNION ALL
SELECT req.i, locked.fencing_token
FROM req JOIN locked USING (operation_id)
WHERE locked.state = 'submitting' AND locked.claim_id = req.claim_id;

-- name: save_submitted
-- Batched, fenced: save the remote job id from a 2xx or from a 502's error.job_id; submitting|uncertain ->
-- submitted. The same statement writes the accounting of the POST that reported the id, whether the save is
-- written or refused: its remote_calls row (for a request with a call id; a call id already written, the same
-- record sent again, is not written twice) and the job's remote_jobs record (kept when one exists).
-- The first poll is due now instead of after its delay when a cancellation is recorded (the observer calls the
-- provider's cancel route at that poll).
-- A request with a first_poll_claim_id also claims the job's first poll for the saving worker, as
-- claim_for_observe would (a new fencing value and poll claim, hinted_at cleared, its claim id on the row; not
-- poll_taken_at: claim_due_polls paces itself by the polls its observers took), unless a cancellation is recorded:
-- its first_poll_delays_s is then when the poll comes back if that worker never takes it (its hint plus the
-- visibility timeout).
-- :operation_ids (text[], distinct), :fencing_tokens (bigint[]), :remote_job_ids (text[]), :first_poll_delays_s first poll
-- delays (s, float8[]), :first_poll_claim_ids (uuid[]; NULL: the poll scheduler claims the first poll),
-- :reasons (NULL for a 2xx; the 502's words when the id came from error.job_id),
-- :call_ids (uuid[]: the POST's accounting row, NULL for none), :call_status_codes (integer[]), :call_outcomes
-- (text[]: 'created' | 'created_via_502'), :call_durations_ms (ms, float8[]) (the row's method is 'POST', its job
-- id and fencing value the request's), :worker, :lock_timeout. Returns i per saved request, and per request whose
-- job id is already on the row (the same save sent again after its reply was lost: a job id belongs to the one POST
-- that created it; the row's fencing value may have risen since, e.g. its first poll taken while the repeat waited
-- out an outage); none when the fencing value is stale or another job id is already saved. With i: first_poll_claimed
-- (the first poll is this request's: claimed by it, or by its first run when this is a repeat and nothing claimed
-- since), then as claim_for_observe returns them: fencing_token, poll_claim_id, poll_count, observed_for_s,
-- cancel_answered and cancel_attempts.
WITH req AS (
    SELECT r.*, c.cancel_recorded, (r.claim_id IS NOT NULL AND NOT c.cancel_recorded) AS claims
    FROM unnest(:operation_ids::text[], :fencing_tokens::bigint[], :remote_job_ids::text[], :first_poll_delays_s::float8[],
                :first_poll_claim_ids::uuid[], :reasons::text[], :call_ids::uuid[], :call_status_codes::integer[],
                :call_outcomes::text[], :call_durations_ms::float8[])
        WITH ORDINALITY AS r(operation_id, fencing_token, remote_job_id, delay_s, claim_id, reason, call_id, status_code,
                             outcome, duration_ms, i)
        CROSS JOIN LATERAL (SELECT EXISTS (SELECT 1 FROM cancellations x WHERE x.operation_id = r.operation_id)
                            AS cancel_recorded) AS c
), locked AS MATERIALIZED (
    SELECT operation_id, state, remote_job_id, fencing_token, poll_claim_id, poll_claimed_at, observe_claim_id,
           poll_count, observing_since, accepted_at, cancel_answered_at, cancel_attempts
    FROM operations
    WHERE operation_id = ANY(:operation_ids::text[]) AND (SELECT set_config('lock_timeout', :lock_timeout, true)) IS NOT NULL
    ORDER BY operation_id
    FOR NO KEY UPDATE
), saved AS (
    UPDATE operations AS o
    SET state = 'submitted',
        remote_job_id = req.remote_job_id,
        reason = req.reason,
        reason_code = CASE WHEN req.reason IS NULL THEN NULL ELSE 'job_id_via_error' END,
        next_poll_at = CASE WHEN req.cancel_recorded THEN now() ELSE now() + make_interval(secs => req.delay_s) END,
        next_lookup_at = NULL,
        fencing_token = o.fencing_token + CASE WHEN req.claims THEN 1 ELSE 0 END,
        poll_claim_id = o.poll_claim_id + CASE WHEN req.claims THEN 1 ELSE 0 END,
        poll_claimed_at = CASE WHEN req.claims THEN NULL ELSE o.poll_claimed_at END,
        observe_claim_id = CASE WHEN req.claims THEN req.claim_id ELSE o.observe_claim_id END,
        hinted_at = CASE WHEN req.claims THEN NULL ELSE o.hinted_at END,
        updated_by = :worker
    FROM req JOIN locked USING (operation_id)
    WHERE o.operation_id = req.operation_id
      AND o.fencing_token = req.fencing_token
      AND locked.state IN ('submitting', 'uncertain')
      AND locked.remote_job_id IS NULL
    RETURNING req.i, o.operation_id, o.remote_job_id, req.reason, req.claims AS first_poll_claimed, o.fencing_token,
              o.poll_claim_id, o.poll_count,
              extract(epoch FROM now() - COALESCE(o.observing_since, o.accepted_at))::float8 AS observed_for_s,
              o.cancel_answered_at IS NOT NULL AS cancel_answered, o.cancel_attempts
), call AS (
    INSERT INTO remote_calls (operation_id, call_id, method, status_code, outcome, remote_job_id, duration_ms,
                              fencing_token, worker)
    SELECT operation_id, call_id, 'POST', status_code, outcome, remote_job_id, duration_ms, fencing_token, :worker
    FROM req
    WHERE call_id IS NOT NULL
    ORDER BY i
    ON CONFLICT (call_id) DO NOTHING
), account AS (
    INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by)
    SELECT req.remote_job_id, req.operation_id,
           CASE WHEN COALESCE(req.outcome = 'created_via_502', req.reason IS NOT NULL) THEN 'post_502'
                ELSE 'post_2xx' END,
           :worker
    FROM req
    WHERE req.operation_id IN (SELECT operation_id FROM saved)
       OR (req.call_id IS NOT NULL AND req.operation_id IN (SELECT operation_id FROM locked))
    ORDER BY req.remote_job_id
    ON CONFLICT (remote_job_id) DO NOTHING
)
SELECT i, first_poll_claimed, fencing_token, poll_claim_id, poll_count, observed_for_s, cancel_answered,
       cancel_attempts
FROM saved
UNION ALL
SELECT req.i,
       COALESCE(locked.observe_claim_id = req.claim_id AND locked.fencing_token = req.fencing_token + 1
                AND locked.poll_claimed_at IS NULL AND locked.state IN ('submitted', 'queued', 'running'), false),
       locked.fencing_token, locked.poll_claim_id, locked.poll_count,
       extract(epoch FROM now() - COALESCE(locked.observing_since, locked.accepted_at))::float8,
       locked.cancel_answered_at IS NOT NULL, locked.cancel_attempts
FROM req JOIN locked USING (operation_id)
WHERE locked.remote_job_id = req.remote_job_id AND locked.fencing_token >= req.fencing_token;

-- name: record_late_job
-- A POST answer whose job id could not be saved (fencing value refused) for an operation already decided: it left
-- submitting and uncertain (an operator's abandon, or an adoption of another job) and does not observe this job.
-- The job's accounting record says 'created_after_decision' (written now if the POST's accounting has not); an
-- operator adopts it (rejected operations) or cancels it at the provider (docs/decisions.md).
-- :operation_id, :remote_job_id, :worker. Returns state (the operation's) when recorded, no row when the operation
-- is not decided (still submitting or uncertain), observes this job, or the job belongs to another operation.
WITH op AS (
    SELECT operation_id, state::text AS state FROM operations
    WHERE operation_id = :operation_id AND state NOT IN ('accepted', 'submitting', 'uncertain')
      AND remote_job_id IS DISTINCT FROM :remote_job_id
), recorded AS (
    INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by)
    SELECT :remote_job_id, operation_id, 'created_after_decision', :worker FROM op
    ON CONFLICT (remote_job_id) DO UPDATE SET learned_via = 'created_after_decision'
    WHERE remote_jobs.operation_id = EXCLUDED.operation_id
    RETURNING operation_id
)
SELECT op.state FROM recorded JOIN op USING (operation_id);

-- name: save_submission_without_job
-- Fenced: submitting -> rejected (definite refusal) or uncertain (unknown outcome), with its reason.
-- :operation_id, :fencing_token, :state new state ('rejected' | 'uncertain'), :reason, :worker,
-- :reason_code. Returns operation_id, also when the row already holds this end at this fencing value (state,
-- reason and code: the same end sent again after its reply was lost; nothing is written again), or no row when
-- refused by the fencing value or the state.
WITH saved AS (
    UPDATE operations
    SET state = :state::operation_state, reason = :reason, reason_code = :reason_code, updated_by = :worker
    WHERE operation_id = :operation_id AND fencing_token = :fencing_token AND state = 'submitting'
    RETURNING operation_id
)
SELECT operation_id FROM saved
UNION ALL
SELECT operation_id FROM operations
WHERE operation_id = :operation_id AND fencing_token = :fencing_token AND state = :state::operation_state
  AND reason = :reason AND reason_code = :reason_code;

-- name: reconcile_stale_submitting
-- Reconciliation: an operation left in 'submitting' longer than :stale_after_s seconds had its dispatcher die or
-- lose contact mid-flight. It becomes 'uncertain' with a reason; it is never resubmitted automatically.
-- The fencing value is kept, so the same dispatcher may still save a late job id (uncertain -> submitted).
-- :stale_after_s stale-after (s), :batch_size, :worker. Returns operation_id.
UPDATE operations AS o
SET state = 'uncertain',
    reason = 'no outcome saved within ' || :stale_after_s::text || ' s of submitting (dispatcher died or lost contact '
             'mid-flight); the POST may have created a job: reconcile, never resubmit automatically',
    reason_code = 'no_outcome_saved',
    updated_by = :worker
FROM (SELECT operation_id FROM operations
      WHERE state = 'submitting' AND updated_at < now() - make_interval(secs => :stale_after_s)
      ORDER BY updated_at LIMIT :batch_size FOR UPDATE SKIP LOCKED) AS stale
WHERE o.operation_id = stale.operation_id
RETURNING o.operation_id;

-- name: claim_due_polls
-- The poll scheduler's claim: due operations get next_poll_at = now + visibility timeout, a new poll_claim_id and
-- poll_claimed_at = now, so a poll lost with a dead worker comes back by itself. Back-pressure (cluster-wide, from
-- the ledger): the polls claimed and not yet taken by an observer (their visibility timeout not passed) stay at
-- most the larger of :least_in_flight and the polls observers took in the last :pace_window_s seconds scaled to
-- :take_target_s seconds.
-- :batch_size, :visibility_timeout_s visibility timeout (s), :least_in_flight (polls; NULL: no bound),
-- :pace_window_s (s), :take_target_s (s). Returns one row per poll claimed: operation_id, remote_job_id,
-- poll_claim_id and claimed_at_ms (the claim's now(), epoch ms of the database's clock: the poll record's
-- claimed_at_ms, never a worker's own clock), due_in_s NULL; then one last row, operation_id NULL, whose due_in_s
-- is the scheduler's sleep as next_due_in_s's poll_due_in_s would read it once this claim committed (seconds to the earliest
-- next_poll_at of a pollable operation, the polls claimed here counted at their new one; negative when one is due
-- still, e.g. a row another transaction held; NULL when none is pollable), so a round costs one statement.
WITH flow AS (
    SELECT (SELECT count(*) FROM operations
            WHERE poll_taken_at > now() - make_interval(secs => :pace_window_s)) AS taken,
           (SELECT count(*) FROM operations
            WHERE poll_claimed_at > now() - make_interval(secs => :visibility_timeout_s)
              AND state IN ('submitted', 'queued', 'running')) AS claimed
    WHERE :least_in_flight::int IS NOT NULL
), claimed AS (
    UPDATE operations AS o
    SET next_poll_at = now() + make_interval(secs => :visibility_timeout_s),
        poll_claim_id = o.poll_claim_id + 1,
        poll_claimed_at = now()
    FROM (SELECT operation_id FROM operations
          WHERE state IN ('submitted', 'queued', 'running') AND next_poll_at <= now()
          ORDER BY next_poll_at
          LIMIT COALESCE((SELECT LEAST(:batch_size, GREATEST(0, GREATEST(:least_in_flight::int,
                                       ceil(taken * :take_target_s::float8 / :pace_window_s::float8)::int) - claimed))
                          FROM flow), :batch_size)
          FOR UPDATE SKIP LOCKED) AS due
    WHERE o.operation_id = due.operation_id
    RETURNING o.operation_id, o.remote_job_id, o.poll_claim_id
)
SELECT operation_id, remote_job_id, poll_claim_id, floor(extract(epoch FROM now()) * 1000)::bigint AS claimed_at_ms,
       NULL::float8 AS due_in_s
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL,
       extract(epoch FROM LEAST(
           (SELECT min(next_poll_at) FROM operations
            WHERE state IN ('submitted', 'queued', 'running')
              AND operation_id NOT IN (SELECT operation_id FROM claimed)),
           (SELECT now() + make_interval(secs => :visibility_timeout_s) WHERE EXISTS (SELECT 1 FROM claimed))
       ) - now())::float8;

-- name: next_due_in_s
-- The poll scheduler's idle check, one round trip: poll_due_in_s, seconds from now until the earliest next_poll_at
-- of a pollable operation (a claimed poll's comes back after its visibility timeout; negative when one is due
-- already; NULL when none is pollable), and reconcile_due_in_s,
-- seconds from now until an operation left 'submitting' passes :submitting_stale_after_s or one left 'accepted'
-- passes :accepted_stale_after_s (negative: one has; NULL: none is in either state). Reads the first entries of
-- the operations_due_polls, operations_submitting and operations_accepted indexes.
SELECT
    extract(epoch FROM (SELECT min(next_poll_at) FROM operations WHERE state IN ('submitted', 'queued', 'running'))
        - now())::float8 AS poll_due_in_s,
    extract(epoch FROM least(
        (SELECT min(updated_at) FROM operations WHERE state = 'submitting')
            + make_interval(secs => :submitting_stale_after_s),
        (SELECT min(updated_at) FROM operations WHERE state = 'accepted')
            + make_interval(secs => :accepted_stale_after_s)
    ) - now())::float8 AS reconcile_due_in_s;

-- name: get_operation
-- :operation_id. One row or none; request is the JSON text as submitted.
SELECT operation_id, state::text AS state, remote_job_id, fencing_token, poll_claim_id, next_poll_at,
       poll_count, reason, last_observation, request::text AS request
FROM operations
WHERE operation_id = :operation_id;

-- name: note_erased_replay
-- :operation_id. A submission with the id of an erased operation (request JSON null: forgotten or purged) came and
-- was dead-lettered: record when (replayed_at, migration 0021), so that streams purge --ids-older-than keeps the id
-- until the copies this replay left on the topics are gone. Returns 1 when recorded, no row when the operation is
-- not erased (or not held).
UPDATE operations SET replayed_at = now()
WHERE operation_id = :operation_id AND request::text = 'null'
RETURNING 1;

-- name: claim_for_observe
-- Batched: the observer's claim for one poll, taken after the Redis lease: a new fencing value and the caller's
-- claim id. It clears hinted_at: the GET that follows comes after every callback recorded so far (callbacks.sql).
-- :operation_ids (text[], distinct), :poll_claim_ids of the poll events (bigint[]), :claim_ids (uuid[]), :worker,
-- :lock_timeout.
-- Returns i, fencing_token, remote_job_id, state, poll_count, observed_for_s (since the observation began: job id
-- saved or repolled), cancel_asked (a cancellation is recorded), cancel_answered (the provider's cancel route gave a
-- definite answer), cancel_attempts per claimed request; none when the poll is stale (re-claimed since), already taken (the same
-- poll event delivered again, e.g. after a rebalance: each scheduler claim is observed at most once, so a
-- redelivered poll makes no second GET; it clears poll_claimed_at, as does a reschedule), the operation is no
-- longer pollable, or it does not exist. The same claim sent again (its reply was lost after the commit) finds
-- its claim id on the row with the same poll claim and gets the claim it wrote; nothing is written again.
WITH req AS (
    SELECT * FROM unnest(:operation_ids::text[], :poll_claim_ids::bigint[], :claim_ids::uuid[])
        WITH ORDINALITY AS r(operation_id, poll_claim_id, claim_id, i)
), locked AS MATERIALIZED (
    SELECT operation_id, state, poll_claimed_at, poll_claim_id, observe_claim_id, fencing_token, remote_job_id,
           poll_count, observing_since, accepted_at, cancel_answered_at, cancel_attempts
    FROM operations
    WHERE operation_id = ANY(:operation_ids::text[]) AND (SELECT set_config('lock_timeout', :lock_timeout, true)) IS NOT NULL
    ORDER BY operation_id
    FOR NO KEY UPDATE
), claimed AS (
    UPDATE operations AS o
    SET fencing_token = o.fencing_token + 1, updated_by = :worker, poll_claimed_at = NULL, poll_taken_at = now(),
        observe_claim_id = req.claim_id, hinted_at = NULL
    FROM req JOIN locked USING (operation_id)
    WHERE o.operation_id = req.operation_id
      AND o.poll_claim_id = req.poll_claim_id
      AND locked.poll_claimed_at IS NOT NULL
      AND locked.state IN ('submitted', 'queued', 'running')
    RETURNING req.i, o.fencing_token, o.remote_job_id, o.state::text AS state, o.poll_count,
              extract(epoch FROM now() - COALESCE(o.observing_since, o.accepted_at))::float8 AS observed_for_s,
              EXISTS (SELECT 1 FROM cancellations c WHERE c.operation_id = o.operation_id) AS cancel_asked,
              o.cancel_answered_at IS NOT NULL AS cancel_answered, o.cancel_attempts
)
SELECT * FROM claimed
UNION ALL
SELECT req.i, locked.fencing_token, locked.remote_job_id, locked.state::text, locked.poll_count,
       extract(epoch FROM now() - COALESCE(locked.observing_since, locked.accepted_at))::float8,
       EXISTS (SELECT 1 FROM cancellations c WHERE c.operation_id = locked.operation_id),
       locked.cancel_answered_at IS NOT NULL, locked.cancel_attempts
FROM req JOIN locked USING (operation_id)
WHERE locked.poll_claimed_at IS NULL
  AND locked.observe_claim_id = req.claim_id
  AND locked.poll_claim_id = req.poll_claim_id
  AND locked.state IN ('submitted', 'queued', 'running');

-- name: reschedule_poll
-- Batched: move claimed polls to now + their delay (lease busy, GET failed, state order refused a save).
-- :operation_ids (text[], distinct), :poll_claim_ids (bigint[]), :delays_s delays (s, float8[]), :lock_timeout.
-- Returns i per rescheduled request; none when the claim is stale or the job no longer pollable.
WITH req AS (
    SELECT * FROM unnest(:operation_ids::text[], :poll_claim_ids::bigint[], :delays_s::float8[]) WITH ORDINALITY AS r(operation_id, poll_claim_id,
                                                                                         delay_s, i)
), locked AS MATERIALIZED (
    SELECT operation_id, state FROM operations
    WHERE operation_id = ANY(:operation_ids::text[]) AND (SELECT set_config('lock_timeout', :lock_timeout, true)) IS NOT NULL
    ORDER BY operation_id
    FOR NO KEY UPDATE
)
UPDATE operations AS o
SET next_poll_at = now() + make_interval(secs => req.delay_s),
    poll_claimed_at = NULL,
    poll_taken_at = CASE WHEN o.poll_claimed_at IS NULL THEN o.poll_taken_at ELSE now() END
FROM req JOIN locked USING (operation_id)
WHERE o.operation_id = req.operation_id
  AND o.poll_claim_id = req.poll_claim_id
  AND locked.state IN ('submitted', 'queued', 'running')
RETURNING req.i;

-- name: save_observation
-- Batched, fenced, conditional save of GET snapshots; for a 'succeeded' one, the outputs and one outbox row per
-- (operation_id, output_id) are written by the same statement (a second row is impossible: primary key and
-- unique index; a repeat is skipped). A known status ends any run of unknown ones and of failed polls. When a snapshot is terminal,
-- the job's accounting record takes its outcome and the provider's charge, and a refund is recorded once per
-- (refund id, job id). A job still pollable whose recorded cancellation has not been called at the provider yet
-- (asked while this poll was being observed) is due again now, not after its delay; so is one whose hinted_at is
-- set (a completion callback came while this poll was being observed, its GET perhaps made before the job ended:
-- callbacks.sql) unless a scheduler claimed the next poll meanwhile (its GET comes after the callback); the save
-- clears hinted_at, so each callback costs at most one extra GET. The same statement writes the remote_calls row
-- of the GET that gave the snapshot, whether the save is written or refused (for a request with a call id; a call
-- id already written, the same record sent again, is not written twice).
-- :operation_ids (text[], distinct), :fencing_tokens (bigint[]), :states new states (text[]), :observations
-- (JSON texts with "status", "charge", "refund"), :next_poll_delays_s next poll delays (s, float8[], NULL when terminal),
-- :remote_completed_at_ms remote completion times (epoch ms, bigint[], NULL unless terminal), :reasons (text[]), :source_states states each new
-- state may be saved over (operation_state[] literals, text[]), :outputs (JSON texts of arrays of
-- {output_id, position, payload, expires_at_ms}; expires_at_ms, epoch ms or null, goes into the delivered event
-- only when not null), :call_ids (uuid[]: the GET's accounting row, NULL for none), :call_status_codes
-- (integer[]), :call_outcomes (text[]), :call_remote_job_ids (text[]), :call_durations_ms (ms, float8[]) (the
-- row's method is 'GET', its fencing value the request's), :worker, :lock_timeout. Returns one row per request: i,
-- saved (boolean), due_now (saved with the next poll due now: a cancellation or a callback came during this
-- poll), and
-- fencing_token: the operation's fencing value when its row was locked (NULL when the operation does not
-- exist), which tells a stale fencing value from a refusal by the state order.
WITH req AS (
    SELECT r.i, r.operation_id, r.fencing_token, r.new_state::operation_state AS new_state,
           r.observation::jsonb AS observation, r.delay_s, r.completed_ms, r.reason,
           r.sources::operation_state[] AS sources, r.outputs::jsonb AS outputs, r.call_id, r.call_status_code,
           r.call_outcome, r.call_remote_job_id, r.call_duration_ms
    FROM unnest(:operation_ids::text[], :fencing_tokens::bigint[], :states::text[], :observations::text[], :next_poll_delays_s::float8[], :remote_completed_at_ms::bigint[], :reasons::text[],
                :source_states::text[], :outputs::text[], :call_ids::uuid[], :call_status_codes::integer[],
                :call_outcomes::text[], :call_remote_job_ids::text[], :call_durations_ms::float8[])
        WITH ORDINALITY AS r(operation_id, fencing_token, new_state, observation, delay_s, completed_ms, reason,
                             sources, outputs, call_id, call_status_code, call_outcome, call_remote_job_id,
                             call_duration_ms, i)
), locked AS MATERIALIZED (
    SELECT operation_id, fencing_token FROM operations
    WHERE operation_id = ANY(:operation_ids::text[]) AND (SELECT set_config('lock_timeout', :lock_timeout, true)) IS NOT NULL
    ORDER BY operation_id
    FOR NO KEY UPDATE
), saved AS (
    UPDATE operations AS o
    SET state = req.new_state,
        last_observation = req.observation,
        last_observed_at = now(),
        poll_count = o.poll_count + 1,
        unknown_status_count = 0,
        failed_poll_count = 0,
        next_poll_at = CASE WHEN req.delay_s IS NULL THEN NULL
                            WHEN o.cancel_attempts = 0 AND o.cancel_answered_at IS NULL
                                 AND EXISTS (SELECT 1 FROM cancellations c WHERE c.operation_id = o.operation_id)
                                THEN now()
                            WHEN o.hinted_at IS NOT NULL AND o.poll_claimed_at IS NULL THEN now()
                            ELSE now() + make_interval(secs => req.delay_s) END,
        hinted_at = NULL,
        remote_completed_at = COALESCE(to_timestamp(req.completed_ms::double precision / 1000.0),
                                       o.remote_completed_at),
        reason = req.reason,
        reason_code = CASE WHEN req.reason IS NULL THEN NULL ELSE 'remote_job_failed' END,
        updated_by = :worker
    FROM req JOIN locked USING (operation_id)
    WHERE o.operation_id = req.operation_id
      AND o.fencing_token = req.fencing_token
      AND o.state = ANY(req.sources)
    RETURNING o.operation_id, o.state, o.remote_job_id, o.next_poll_at <= now() AS due_now
), outs AS (
    INSERT INTO outputs (operation_id, output_id, position, payload)
    SELECT saved.operation_id, x.output_id, x.position, x.payload
    FROM saved JOIN req USING (operation_id),
         jsonb_to_recordset(req.outputs) AS x(output_id text, position integer, payload jsonb)
    WHERE saved.state = 'succeeded'
    ORDER BY saved.operation_id, x.position
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
               'remote_completed_at_ms', req.completed_ms,
               'recorded_at_ms', floor(extract(epoch FROM outs.recorded_at) * 1000)::bigint)
           || CASE WHEN e.expires_at_ms IS NULL THEN '{}'::jsonb
                   ELSE jsonb_build_object('expires_at_ms', e.expires_at_ms) END
    FROM outs JOIN saved USING (operation_id) JOIN req USING (operation_id)
         CROSS JOIN LATERAL (SELECT x.expires_at_ms
                             FROM jsonb_to_recordset(req.outputs) AS x(output_id text, expires_at_ms bigint)
                             WHERE x.output_id = outs.output_id LIMIT 1) AS e
    ORDER BY outs.operation_id, outs.position
    ON CONFLICT DO NOTHING
    RETURNING 1
), account AS (
    UPDATE remote_jobs AS j
    SET outcome = saved.state::text,
        outcome_at = now(),
        last_status = left(req.observation ->> 'status', 80),
        charge = CASE WHEN jsonb_typeof(req.observation -> 'charge') = 'object' THEN req.observation -> 'charge' END,
        charge_amount = CASE WHEN req.observation #>> '{charge,amount}' ~ '^-?[0-9]{1,30}(\.[0-9]{1,30})?$'
                             THEN (req.observation #>> '{charge,amount}')::numeric END,
        charge_currency = left(req.observation #>> '{charge,currency}', 16)
    FROM saved JOIN req USING (operation_id)
    WHERE j.remote_job_id = saved.remote_job_id AND saved.state IN ('succeeded', 'failed', 'canceled')
    RETURNING j.remote_job_id, saved.operation_id
), refund AS (
    INSERT INTO refunds (refund_id, remote_job_id, refund, amount, currency)
    SELECT req.observation #>> '{refund,id}',
           account.remote_job_id,
           req.observation -> 'refund',
           CASE WHEN req.observation #>> '{refund,amount}' ~ '^-?[0-9]{1,30}(\.[0-9]{1,30})?$'
                THEN (req.observation #>> '{refund,amount}')::numeric END,
           left(req.observation #>> '{refund,currency}', 16)
    FROM account JOIN req USING (operation_id)
    WHERE jsonb_typeof(req.observation #> '{refund,id}') = 'string'
    ON CONFLICT (refund_id, remote_job_id) DO NOTHING
), call AS (
    INSERT INTO remote_calls (operation_id, call_id, method, status_code, outcome, remote_job_id, duration_ms,
                              fencing_token, worker)
    SELECT operation_id, call_id, 'GET', call_status_code, call_outcome, call_remote_job_id, call_duration_ms,
           fencing_token, :worker
    FROM req
    WHERE call_id IS NOT NULL
    ORDER BY i
    ON CONFLICT (call_id) DO NOTHING
)
SELECT req.i, saved.operation_id IS NOT NULL AS saved, COALESCE(saved.due_now, false) AS due_now,
       locked.fencing_token
FROM req LEFT JOIN saved USING (operation_id) LEFT JOIN locked USING (operation_id);

-- name: save_stalled
-- Fenced: a pollable operation whose provider answers stopped making progress -> stalled, with the reason and
-- the raw last answer; nothing polls it until an operator repolls or fails it.
-- :operation_id, :fencing_token, :reason, :last_answer (jsonb), :worker. Returns operation_id, or no
-- row when refused (stale fencing value, or no longer pollable).
WITH stalled AS (
    UPDATE operations
    SET state = 'stalled',
        reason = :reason,
        reason_code = 'max_age',
        last_observation = :last_answer::jsonb,
        last_observed_at = now(),
        next_poll_at = NULL,
        updated_by = :worker
    WHERE operation_id = :operation_id AND fencing_token = :fencing_token AND state IN ('submitted', 'queued', 'running')
    RETURNING operation_id, remote_job_id
), account AS (
    UPDATE remote_jobs AS j
    SET last_status = left(:last_answer::jsonb ->> 'status', 80)
    FROM stalled
    WHERE j.remote_job_id = stalled.remote_job_id AND :last_answer::jsonb ? 'status'
)
SELECT operation_id FROM stalled;

-- name: note_not_found
-- Fenced: the job's GET answered 404. Within :grace_s seconds of saving the job id (providers commonly answer 404
-- for a while after creating a job) the poll is only rescheduled :next_poll_delay_s seconds out; past it, -> stalled with the
-- reason :reason and the raw answer :answer.
-- :operation_id, :fencing_token, :grace_s grace (s), :next_poll_delay_s next poll delay (s), :reason, :answer (jsonb),
-- :worker. Returns the state afterwards ('stalled' or the pollable state), or no row when refused.
UPDATE operations AS o
SET state = CASE WHEN o.remote_job_id_saved_at < now() - make_interval(secs => :grace_s) THEN 'stalled'
                 ELSE o.state END,
    reason = CASE WHEN o.remote_job_id_saved_at < now() - make_interval(secs => :grace_s) THEN :reason ELSE o.reason END,
    reason_code = CASE WHEN o.remote_job_id_saved_at < now() - make_interval(secs => :grace_s) THEN 'job_not_found'
                       ELSE o.reason_code END,
    last_observation = CASE WHEN o.remote_job_id_saved_at < now() - make_interval(secs => :grace_s) THEN :answer::jsonb
                            ELSE o.last_observation END,
    next_poll_at = CASE WHEN o.remote_job_id_saved_at < now() - make_interval(secs => :grace_s) THEN NULL
                        ELSE now() + make_interval(secs => :next_poll_delay_s) END,
    poll_count = o.poll_count + 1,
    last_observed_at = now(),
    updated_by = :worker
WHERE o.operation_id = :operation_id AND o.fencing_token = :fencing_token AND o.state IN ('submitted', 'queued', 'running')
RETURNING o.state::text AS state;

-- name: note_poll_setback
-- Fenced: the job's GET gave no usable observation, a setback of the kind :setback (its reason code):
-- 'unknown_status' (a status the client does not know; the raw answer :answer becomes the last observation at
-- once) or 'poll_failures' (the GET failed: an answer that cannot be used, a timeout, a lost connection, a 429;
-- the last observation is kept until it stalls). It counts as a poll (poll_count: the backoff grows) and as one
-- more setback of its kind in a row (unknown_status_count or failed_poll_count); the :setback_limit-th in a row ->
-- stalled with the reason :reason, reason code :setback and :answer as the last observation; before that the poll
-- is rescheduled :next_poll_delay_s seconds out. The row is locked first, so the count is the committed one.
-- :operation_id, :fencing_token, :setback ('unknown_status' | 'poll_failures'), :setback_limit (setbacks in a
-- row), :next_poll_delay_s next poll delay (s), :reason, :answer (jsonb), :worker. Returns the state afterwards
-- and in_a_row (setbacks of that kind in a row), or no row when refused (stale fencing value, or no longer
-- pollable).
WITH cur AS (
    SELECT c.operation_id,
           CASE :setback WHEN 'unknown_status' THEN c.unknown_status_count ELSE c.failed_poll_count END + 1 AS in_a_row
    FROM operations AS c
    WHERE c.operation_id = :operation_id AND c.fencing_token = :fencing_token
      AND c.state IN ('submitted', 'queued', 'running')
    FOR UPDATE
)
UPDATE operations AS o
SET state = CASE WHEN cur.in_a_row >= :setback_limit THEN 'stalled' ELSE o.state END,
    reason = CASE WHEN cur.in_a_row >= :setback_limit THEN :reason ELSE o.reason END,
    reason_code = CASE WHEN cur.in_a_row >= :setback_limit THEN :setback ELSE o.reason_code END,
    last_observation = CASE WHEN cur.in_a_row >= :setback_limit OR :setback = 'unknown_status' THEN :answer::jsonb
                            ELSE o.last_observation END,
    last_observed_at = CASE WHEN :setback = 'unknown_status' THEN now() ELSE o.last_observed_at END,
    next_poll_at = CASE WHEN cur.in_a_row >= :setback_limit THEN NULL
                        ELSE now() + make_interval(secs => :next_poll_delay_s) END,
    unknown_status_count = CASE WHEN :setback = 'unknown_status' THEN cur.in_a_row ELSE o.unknown_status_count END,
    failed_poll_count = CASE WHEN :setback = 'poll_failures' THEN cur.in_a_row ELSE o.failed_poll_count END,
    poll_count = o.poll_count + 1,
    updated_by = :worker
FROM cur
WHERE o.operation_id = cur.operation_id
RETURNING o.state::text AS state, cur.in_a_row;

-- name: record_remote_call
-- Batched accounting: one row per remote call attempt. A POST that reported a job id (outcome 'created' or
-- 'created_via_502') also gives the job its accounting record, even if the id is never saved on the operation.
-- A row whose call id is already written (the same record sent again after its reply was lost) is not written
-- again.
-- :operation_ids (text[]; may repeat), :call_ids (uuid[], distinct), :methods (text[]), :status_codes (integer[]),
-- :outcomes (text[]), :remote_job_ids (text[]), :durations_ms durations (ms, float8[]), :fencing_tokens (bigint[]),
-- :worker, :lock_timeout.
WITH req AS (
    SELECT * FROM unnest(:operation_ids::text[], :call_ids::uuid[], :methods::text[], :status_codes::integer[], :outcomes::text[], :remote_job_ids::text[], :durations_ms::float8[], :fencing_tokens::bigint[])
        WITH ORDINALITY AS r(operation_id, call_id, method, status_code, outcome, remote_job_id, duration_ms, fencing_token, i)
    WHERE (SELECT set_config('lock_timeout', :lock_timeout, true)) IS NOT NULL
), call AS (
    INSERT INTO remote_calls (operation_id, call_id, method, status_code, outcome, remote_job_id, duration_ms,
                              fencing_token, worker)
    SELECT operation_id, call_id, method, status_code, outcome, remote_job_id, duration_ms, fencing_token, :worker
    FROM req
    ORDER BY i
    ON CONFLICT (call_id) DO NOTHING
)
INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by)
SELECT req.remote_job_id, req.operation_id,
       CASE WHEN req.outcome = 'created_via_502' THEN 'post_502' ELSE 'post_2xx' END, :worker
FROM req
WHERE req.method = 'POST' AND req.remote_job_id IS NOT NULL AND req.outcome IN ('created', 'created_via_502')
  AND EXISTS (SELECT 1 FROM operations WHERE operation_id = req.operation_id)
ORDER BY req.remote_job_id, req.i
ON CONFLICT (remote_job_id) DO NOTHING;

-- name: lock_unpublished_outbox
-- Every unpublished row, never "ids above the last one published": an id is taken when its transaction
-- writes the row, so a lower id can commit after a higher one was published; it is picked up next round.
-- Rows of one operation are written under its row lock, so their ids follow their commit order.
-- :skip_operation_ids (text[]): operations whose rows are left out (their Kafka partition is blocked: every row
-- of one operation goes to one partition, so leaving all of them out keeps their order), so they do not fill the
-- batch ahead of the others.
-- One relay publishes at a time (keeps each operation's events in order): the statement first takes the relay's
-- transaction-scoped advisory lock without waiting (a one-time filter, evaluated before any row is read or
-- locked); the caller's transaction keeps the lock until it has marked what it published.
-- :relay_lock_name: the lock's name (streams.ledger.store.OUTBOX_RELAY_LOCK_NAME, hashed by hashtext).
-- :batch_size. Returns held (whether this transaction took the lock) with id, event_id, topic_role, operation_id,
-- payload (text) and expires_at_ms (a delivered output's, epoch ms, else NULL), in id order; one row of held alone
-- (the others NULL) when the outbox is drained (held true) or another relay holds the lock (held false).
WITH relay_lock AS MATERIALIZED (
    SELECT pg_try_advisory_xact_lock(hashtext(:relay_lock_name)) AS held
)
SELECT l.held, o.id, o.event_id, o.topic_role, o.operation_id, o.payload::text AS payload,
       CASE WHEN jsonb_typeof(o.payload -> 'expires_at_ms') = 'number' THEN (o.payload ->> 'expires_at_ms')::bigint
       END AS expires_at_ms
FROM relay_lock AS l
LEFT JOIN LATERAL (
    SELECT id, event_id, topic_role, operation_id, payload
    FROM outbox
    WHERE l.held AND published_at IS NULL AND NOT (operation_id = ANY(:skip_operation_ids::text[]))
    ORDER BY id
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
) AS o ON true
ORDER BY o.id;

-- name: probe_outbox
-- Whether a relay round would find work, in one statement outside a transaction (a round costs three: BEGIN, the
-- select of lock_unpublished_outbox, COMMIT): takes the relay's advisory lock without waiting, for this statement
-- only, and looks for an unpublished row only when it took the lock (never a row read or locked).
-- :relay_lock_name and :skip_operation_ids (text[]) as for lock_unpublished_outbox. Returns one row: held (the lock was free), pending (held and a row waits).
WITH relay_lock AS MATERIALIZED (
    SELECT pg_try_advisory_xact_lock(hashtext(:relay_lock_name)) AS held
)
SELECT l.held,
       CASE WHEN l.held THEN EXISTS (
           SELECT 1 FROM outbox
           WHERE published_at IS NULL AND NOT (operation_id = ANY(:skip_operation_ids::text[]))
       ) ELSE false END AS pending
FROM relay_lock AS l;

-- name: mark_outbox_published!
-- :outbox_ids (bigint[]).
UPDATE outbox SET published_at = now() WHERE id = ANY(:outbox_ids::bigint[]);

-- name: announce_transitions
-- Wake every listening relay for transitions as the outbox trigger would: a stopping worker's, which the trigger
-- does not notify (migrations/0019.worker-transitions.sql). :channel (streams.ledger.notices.OUTBOX_CHANNEL),
-- :payload (streams.ledger.notices.TRANSITIONS_PAYLOAD).
SELECT pg_notify(:channel, :payload);

-- name: stale_accepted
-- Defence in depth: operations still 'accepted' more than :stale_after_s seconds after their last change. A dispatcher
-- claims an operation milliseconds after accepting it; one left here had its event handled by a worker that
-- died before the claim (or never read again). Nothing was sent for it, so it may be dispatched again,
-- through the dispatcher's own submit lease and fenced claim (accepted -> submitting): whoever claims first
-- POSTs, the other finds it past 'accepted'.
-- :stale_after_s stale-after (s), :batch_size. Returns operation_id, request (the JSON text as submitted), oldest first.
SELECT operation_id, request::text AS request
FROM operations
WHERE state = 'accepted' AND updated_at < now() - make_interval(secs => :stale_after_s)
ORDER BY updated_at
LIMIT :batch_size;
