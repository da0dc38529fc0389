-- Back to 0008. Refused while a rejected operation's late job was adopted (the transition log holds
-- rejected -> submitted, which 0008 cannot represent, and history is never rewritten). Jobs recorded as created
-- after a decision go back to how their POST reported them (remote_calls).

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM transitions WHERE from_state = 'rejected' AND to_state = 'submitted') THEN
        RAISE EXCEPTION 'the transition log holds rejected -> submitted (a late job adopted); 0008 cannot represent it';
    END IF;
END
$$;

DROP TRIGGER operations_late_job_guard ON operations;
DROP FUNCTION operations_late_job_guard();

DELETE FROM operation_state_transitions WHERE from_state = 'rejected' AND to_state = 'submitted';

UPDATE operations SET reason_code = 'unclassified' WHERE reason_code = 'adopted_after_decision';
DELETE FROM reason_codes WHERE reason_code = 'adopted_after_decision';

UPDATE remote_jobs AS j
SET learned_via = CASE WHEN EXISTS (
        SELECT 1 FROM remote_calls c
        WHERE c.remote_job_id = j.remote_job_id AND c.method = 'POST' AND c.outcome = 'created_via_502'
    ) THEN 'post_502' ELSE 'post_2xx' END
WHERE j.learned_via = 'created_after_decision';
ALTER TABLE remote_jobs DROP CONSTRAINT remote_jobs_learned_via_check;
ALTER TABLE remote_jobs ADD CONSTRAINT remote_jobs_learned_via_check
    CHECK (learned_via IN ('post_2xx', 'post_502', 'adopted', 'lookup', 'duplicate'));
