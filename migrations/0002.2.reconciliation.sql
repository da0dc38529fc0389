-- Reconciliation: the stalled state's moves and rules, operators' moves out of uncertain, a per-operation
-- transition sequence (a state may be entered more than once: stalled -> submitted -> stalled), lookup and
-- observation bookkeeping, and the accounting of remote jobs and refunds.
-- depends: 0002.1.stalled-state

-- Legal moves added (mirrored by streams.model.states._ALLOWED):
--   observer: a pollable job whose answers stopped making progress -> stalled;
--   operator: stalled -> submitted (observe again) or failed; uncertain -> rejected (checked: not created).
INSERT INTO operation_state_transitions (from_state, to_state) VALUES
    ('submitted', 'stalled'), ('queued', 'stalled'), ('running', 'stalled'),
    ('stalled', 'submitted'), ('stalled', 'failed'),
    ('uncertain', 'rejected');

ALTER TABLE operations
    -- 1 for 'accepted', +1 per state change (kept by operations_guard); names each transition's event.
    ADD COLUMN transition_seq integer NOT NULL DEFAULT 1 CHECK (transition_seq >= 1),
    ADD COLUMN state_entered_at timestamptz NOT NULL DEFAULT now(),
    -- set by operations_guard when the remote job id is saved; the 404 grace window counts from it
    ADD COLUMN remote_job_id_saved_at timestamptz,
    -- start of the current observation (job id saved, or an operator's repoll); the maximum age counts from it
    ADD COLUMN observing_since timestamptz,
    -- consecutive GET answers with a status the client does not know
    ADD COLUMN unknown_status_count integer NOT NULL DEFAULT 0 CHECK (unknown_status_count >= 0),
    -- the reconciler's lookup by client reference (uncertain only): next due time, attempts, and when it
    -- gave up (nothing found after the provider's consistency lag: left for a person)
    ADD COLUMN next_lookup_at timestamptz,
    ADD COLUMN lookup_count integer NOT NULL DEFAULT 0 CHECK (lookup_count >= 0),
    ADD COLUMN lookup_gave_up_at timestamptz;

ALTER TABLE operations DISABLE TRIGGER operations_guard;  -- the backfill changes no state: keep updated_at
UPDATE operations AS o
SET transition_seq = t.n, state_entered_at = t.last_at
FROM (SELECT operation_id, count(*)::integer AS n, max(at) AS last_at FROM transitions GROUP BY operation_id) AS t
WHERE o.operation_id = t.operation_id;
UPDATE operations AS o
SET remote_job_id_saved_at = COALESCE(
        (SELECT min(t.at) FROM transitions t WHERE t.operation_id = o.operation_id AND t.to_state = 'submitted'),
        o.accepted_at),
    observing_since = COALESCE(
        (SELECT min(t.at) FROM transitions t WHERE t.operation_id = o.operation_id AND t.to_state = 'submitted'),
        o.accepted_at)
WHERE o.remote_job_id IS NOT NULL;
ALTER TABLE operations ENABLE TRIGGER operations_guard;

ALTER TABLE operations
    DROP CONSTRAINT reason_when_uncertain_or_rejected,
    ADD CONSTRAINT reason_when_uncertain_rejected_or_stalled CHECK (
        state NOT IN ('uncertain', 'rejected', 'stalled') OR reason IS NOT NULL
    ),
    ADD CONSTRAINT last_answer_kept_when_stalled CHECK (
        state <> 'stalled' OR last_observation IS NOT NULL
    ),
    ADD CONSTRAINT looked_up_only_while_uncertain CHECK (
        next_lookup_at IS NULL OR state = 'uncertain'
    );

CREATE INDEX operations_due_lookups ON operations (next_lookup_at)
    WHERE state = 'uncertain' AND lookup_gave_up_at IS NULL;

-- Transition log: a sequence number per operation replaces "each state at most once".
ALTER TABLE transitions ADD COLUMN seq integer;
UPDATE transitions AS t
SET seq = n.seq
FROM (SELECT id, row_number() OVER (PARTITION BY operation_id ORDER BY id)::integer AS seq FROM transitions) AS n
WHERE t.id = n.id;
ALTER TABLE transitions
    ALTER COLUMN seq SET NOT NULL,
    DROP CONSTRAINT transitions_operation_id_to_state_key,
    ADD CONSTRAINT transitions_operation_id_seq_key UNIQUE (operation_id, seq);

-- Refuse illegal transitions, fencing regressions and job-id rewrites; keep the transition sequence, the time
-- the state was entered, and when the job id was saved.
CREATE OR REPLACE FUNCTION operations_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        IF NOT EXISTS (
            SELECT 1 FROM operation_state_transitions t
            WHERE t.from_state = OLD.state AND t.to_state = NEW.state
        ) THEN
            RAISE EXCEPTION 'illegal transition % -> % for operation %', OLD.state, NEW.state, OLD.operation_id
                USING ERRCODE = 'check_violation';
        END IF;
        NEW.transition_seq := OLD.transition_seq + 1;
        NEW.state_entered_at := now();
    ELSE
        NEW.transition_seq := OLD.transition_seq;
    END IF;
    IF NEW.fencing_token < OLD.fencing_token THEN
        RAISE EXCEPTION 'fencing token of operation % would go back from % to %',
            OLD.operation_id, OLD.fencing_token, NEW.fencing_token USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.remote_job_id IS NOT NULL AND NEW.remote_job_id IS DISTINCT FROM OLD.remote_job_id THEN
        RAISE EXCEPTION 'remote job id of operation % is saved and never changes', OLD.operation_id
            USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.remote_job_id IS NULL AND NEW.remote_job_id IS NOT NULL THEN
        NEW.remote_job_id_saved_at := now();
        NEW.observing_since := now();
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

-- Every state change is logged by the database itself, in the same transaction as the change: one row in
-- the transition log and one outbox event for generation.transitions. The event id
-- transition:<op>:<seq>:<state> is deterministic (seq is the operation's transition sequence number), and
-- unique even when a state is entered twice.
CREATE OR REPLACE FUNCTION operations_log_transition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    previous operation_state;
    event text;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.state IS NOT DISTINCT FROM OLD.state THEN
            RETURN NULL;
        END IF;
        previous := OLD.state;
    END IF;
    event := 'transition:' || NEW.operation_id || ':' || NEW.transition_seq || ':' || NEW.state;
    INSERT INTO transitions (operation_id, seq, from_state, to_state, fencing_token, reason, worker)
    VALUES (NEW.operation_id, NEW.transition_seq, previous, NEW.state, NEW.fencing_token, NEW.reason, NEW.updated_by);
    INSERT INTO outbox (event_id, topic_role, operation_id, payload)
    VALUES (
        event,
        'transitions',
        NEW.operation_id,
        jsonb_build_object(
            'event_id', event,
            'operation_id', NEW.operation_id,
            'seq', NEW.transition_seq,
            'from_state', previous,
            'to_state', NEW.state,
            'fencing_token', NEW.fencing_token,
            'remote_job_id', NEW.remote_job_id,
            'reason', NEW.reason,
            'at_ms', floor(extract(epoch FROM now()) * 1000)::bigint));
    RETURN NULL;
END
$$;

-- Accounting: one record per remote job the system learns of, however it learned of it. Never consulted to
-- decide whether a job was created.
CREATE TABLE remote_jobs (
    remote_job_id   text PRIMARY KEY,
    operation_id    text NOT NULL REFERENCES operations (operation_id),
    -- post_2xx: the POST's 2xx; post_502: a 502's error.job_id; adopted: an operator's decision;
    -- lookup: the reconciler's lookup by client reference; duplicate: a further job found by that lookup
    learned_via     text NOT NULL CHECK (learned_via IN ('post_2xx', 'post_502', 'adopted', 'lookup', 'duplicate')),
    learned_by      text NOT NULL,
    learned_at      timestamptz NOT NULL DEFAULT now(),
    last_status     text,            -- the provider's last status seen for the job (its own word)
    outcome         text CHECK (outcome IN ('succeeded', 'failed', 'canceled')),  -- terminal, as observed
    outcome_at      timestamptz,
    charge          jsonb,           -- the provider's charge, as the observation carried it
    charge_amount   numeric,         -- its amount when it is a readable decimal, else NULL
    charge_currency text
);

CREATE INDEX remote_jobs_operation ON remote_jobs (operation_id);

-- Refunds, recorded idempotently by (refund id, job id).
CREATE TABLE refunds (
    refund_id     text NOT NULL,
    remote_job_id text NOT NULL REFERENCES remote_jobs (remote_job_id),
    refund        jsonb NOT NULL,    -- as the observation carried it
    amount        numeric,
    currency      text,
    recorded_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (refund_id, remote_job_id)
);

-- Jobs learned before this migration: from saved job ids, then from POSTs that reported one.
INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by, learned_at, outcome, outcome_at)
SELECT o.remote_job_id,
       o.operation_id,
       CASE WHEN o.reason LIKE 'job id from HTTP 502%' THEN 'post_502' ELSE 'post_2xx' END,
       'migration 0002',
       COALESCE(o.remote_job_id_saved_at, o.accepted_at),
       CASE WHEN o.state IN ('succeeded', 'failed', 'canceled') THEN o.state::text END,
       o.remote_completed_at
FROM operations o
WHERE o.remote_job_id IS NOT NULL;
INSERT INTO remote_jobs (remote_job_id, operation_id, learned_via, learned_by, learned_at)
SELECT DISTINCT ON (c.remote_job_id)
       c.remote_job_id,
       c.operation_id,
       CASE WHEN c.outcome = 'created_via_502' THEN 'post_502' ELSE 'post_2xx' END,
       'migration 0002',
       c.at
FROM remote_calls c
JOIN operations o ON o.operation_id = c.operation_id
WHERE c.method = 'POST' AND c.remote_job_id IS NOT NULL
ORDER BY c.remote_job_id, c.id
ON CONFLICT (remote_job_id) DO NOTHING;
