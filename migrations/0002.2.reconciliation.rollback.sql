-- Back to 0002.1. Refused while an operation is stalled, when the transition log holds a stalled step (0001's
-- enum cannot represent it and history is never rewritten), or when one operation entered a state twice (0001's
-- log allows each state once).

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM operations WHERE state = 'stalled') THEN
        RAISE EXCEPTION 'operations are stalled: repoll or fail them before rolling back 0002.2';
    END IF;
    IF EXISTS (SELECT 1 FROM transitions WHERE to_state = 'stalled') THEN
        RAISE EXCEPTION 'the transition log holds stalled steps; 0001 cannot represent them';
    END IF;
    IF EXISTS (SELECT 1 FROM transitions GROUP BY operation_id, to_state HAVING count(*) > 1) THEN
        RAISE EXCEPTION 'an operation entered a state twice; the 0001 transition log cannot hold it';
    END IF;
END
$$;

DROP TABLE refunds;
DROP TABLE remote_jobs;

CREATE OR REPLACE FUNCTION operations_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IS DISTINCT FROM OLD.state AND NOT EXISTS (
        SELECT 1 FROM operation_state_transitions t
        WHERE t.from_state = OLD.state AND t.to_state = NEW.state
    ) THEN
        RAISE EXCEPTION 'illegal transition % -> % for operation %', OLD.state, NEW.state, OLD.operation_id
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.fencing_token < OLD.fencing_token THEN
        RAISE EXCEPTION 'fencing token of operation % would go back from % to %',
            OLD.operation_id, OLD.fencing_token, NEW.fencing_token USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.remote_job_id IS NOT NULL AND NEW.remote_job_id IS DISTINCT FROM OLD.remote_job_id THEN
        RAISE EXCEPTION 'remote job id of operation % is saved and never changes', OLD.operation_id
            USING ERRCODE = 'check_violation';
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION operations_log_transition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    previous operation_state;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.state IS NOT DISTINCT FROM OLD.state THEN
            RETURN NULL;
        END IF;
        previous := OLD.state;
    END IF;
    INSERT INTO transitions (operation_id, from_state, to_state, fencing_token, reason, worker)
    VALUES (NEW.operation_id, previous, NEW.state, NEW.fencing_token, NEW.reason, NEW.updated_by);
    INSERT INTO outbox (event_id, topic_role, operation_id, payload)
    VALUES (
        'transition:' || NEW.operation_id || ':' || NEW.state,
        'transitions',
        NEW.operation_id,
        jsonb_build_object(
            'event_id', 'transition:' || NEW.operation_id || ':' || NEW.state,
            'operation_id', NEW.operation_id,
            'from_state', previous,
            'to_state', NEW.state,
            'fencing_token', NEW.fencing_token,
            'remote_job_id', NEW.remote_job_id,
            'reason', NEW.reason,
            'at_ms', floor(extract(epoch FROM now()) * 1000)::bigint));
    RETURN NULL;
END
$$;

ALTER TABLE transitions
    DROP CONSTRAINT transitions_operation_id_seq_key,
    ADD CONSTRAINT transitions_operation_id_to_state_key UNIQUE (operation_id, to_state),
    DROP COLUMN seq;

DROP INDEX operations_due_lookups;
ALTER TABLE operations
    DROP CONSTRAINT looked_up_only_while_uncertain,
    DROP CONSTRAINT last_answer_kept_when_stalled,
    DROP CONSTRAINT reason_when_uncertain_rejected_or_stalled,
    ADD CONSTRAINT reason_when_uncertain_or_rejected CHECK (
        state NOT IN ('uncertain', 'rejected') OR reason IS NOT NULL
    ),
    DROP COLUMN transition_seq,
    DROP COLUMN state_entered_at,
    DROP COLUMN remote_job_id_saved_at,
    DROP COLUMN observing_since,
    DROP COLUMN unknown_status_count,
    DROP COLUMN next_lookup_at,
    DROP COLUMN lookup_count,
    DROP COLUMN lookup_gave_up_at;

-- Operations that an operator abandoned (uncertain -> rejected) stay rejected; only the move is removed.
DELETE FROM operation_state_transitions
WHERE (from_state, to_state) IN (
    ('submitted', 'stalled'), ('queued', 'stalled'), ('running', 'stalled'),
    ('stalled', 'submitted'), ('stalled', 'failed'),
    ('uncertain', 'rejected'));
