-- Back to 0011. Refused while the transition log holds accepted -> canceled (history is never rewritten) or a
-- cancel route call is accounted (0011 cannot represent method 'CANCEL').
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM transitions WHERE from_state = 'accepted' AND to_state = 'canceled') THEN
        RAISE EXCEPTION 'the transition log holds accepted -> canceled; 0011 cannot represent it';
    END IF;
    IF EXISTS (SELECT 1 FROM remote_calls WHERE method = 'CANCEL') THEN
        RAISE EXCEPTION 'remote_calls holds calls of the cancel route; 0011 cannot represent them';
    END IF;
END
$$;

ALTER TABLE operations
    DROP CONSTRAINT job_id_once_submitted,
    ADD CONSTRAINT job_id_once_submitted CHECK (
        state IN ('accepted', 'submitting', 'uncertain', 'rejected') OR remote_job_id IS NOT NULL
    );
ALTER TABLE operations DROP COLUMN cancel_answered_at, DROP COLUMN cancel_outcome, DROP COLUMN cancel_attempts;
ALTER TABLE remote_calls DROP CONSTRAINT remote_calls_method_check;
ALTER TABLE remote_calls ADD CONSTRAINT remote_calls_method_check CHECK (method IN ('POST', 'GET'));
DELETE FROM remote_call_outcomes WHERE outcome IN
    ('cancel_accepted', 'cancel_already_terminal', 'cancel_not_found', 'cancel_refused', 'cancel_unknown_outcome');
DELETE FROM reason_codes WHERE reason_code = 'canceled_before_submit';
DELETE FROM operation_state_transitions WHERE from_state = 'accepted' AND to_state = 'canceled';
DROP TABLE cancellations;
