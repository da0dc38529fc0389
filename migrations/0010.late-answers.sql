-- Late answers after a decision: a POST's answer (a job id) that arrives after an operator's decision
-- (`abandon`, or an `adopt` of another job) can no longer be saved on the operation (its fencing value is old).
-- Its job is recorded in the accounting as learned_via 'created_after_decision' (streams/ledger/queries/ledger.sql
-- record_late_job), and an operator may adopt exactly that job for a rejected operation: the legal move
-- rejected -> submitted (mirrored by streams.model.states), which the trigger operations_late_job_guard refuses
-- for any other job (docs/decisions.md).
-- depends: 0009.poll-failures

ALTER TABLE remote_jobs DROP CONSTRAINT remote_jobs_learned_via_check;
ALTER TABLE remote_jobs ADD CONSTRAINT remote_jobs_learned_via_check
    CHECK (learned_via IN ('post_2xx', 'post_502', 'adopted', 'lookup', 'duplicate', 'created_after_decision'));

INSERT INTO reason_codes (reason_code) VALUES ('adopted_after_decision');

INSERT INTO operation_state_transitions (from_state, to_state) VALUES ('rejected', 'submitted');

-- rejected -> submitted only with a job id the accounting holds for this operation as created after a decision.
CREATE FUNCTION operations_late_job_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.state = 'rejected' AND NEW.state = 'submitted' AND NOT EXISTS (
        SELECT 1 FROM remote_jobs j
        WHERE j.remote_job_id = NEW.remote_job_id AND j.operation_id = NEW.operation_id
          AND j.learned_via = 'created_after_decision'
    ) THEN
        RAISE EXCEPTION 'illegal transition rejected -> submitted for operation %: only a job created after the '
            'decision (remote_jobs.learned_via = created_after_decision) may be adopted', OLD.operation_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER operations_late_job_guard BEFORE UPDATE OF state ON operations
    FOR EACH ROW WHEN (OLD.state = 'rejected' AND NEW.state = 'submitted')
    EXECUTE FUNCTION operations_late_job_guard();
