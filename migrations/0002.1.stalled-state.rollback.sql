-- PostgreSQL cannot drop an enum value: the type is rebuilt without 'stalled', with everything that uses it
-- (0002.2's rollback has already refused to run while an operation is stalled).

DROP TRIGGER operations_log_transition ON operations;
DROP INDEX operations_due_polls;
DROP INDEX operations_submitting;
DROP INDEX operations_state;
ALTER TABLE operations
    DROP CONSTRAINT job_id_once_submitted,
    DROP CONSTRAINT reason_when_uncertain_or_rejected,
    DROP CONSTRAINT polled_only_while_pollable,
    ALTER COLUMN state DROP DEFAULT;

ALTER TYPE operation_state RENAME TO operation_state_with_stalled;
CREATE TYPE operation_state AS ENUM (
    'accepted', 'submitting', 'submitted', 'queued', 'running',
    'succeeded', 'failed', 'canceled', 'uncertain', 'rejected'
);

ALTER TABLE operation_state_transitions
    ALTER COLUMN from_state TYPE operation_state USING from_state::text::operation_state,
    ALTER COLUMN to_state TYPE operation_state USING to_state::text::operation_state;
ALTER TABLE transitions
    ALTER COLUMN from_state TYPE operation_state USING from_state::text::operation_state,
    ALTER COLUMN to_state TYPE operation_state USING to_state::text::operation_state;
ALTER TABLE operations
    ALTER COLUMN state TYPE operation_state USING state::text::operation_state,
    ALTER COLUMN state SET DEFAULT 'accepted',
    ADD CONSTRAINT job_id_once_submitted CHECK (
        state IN ('accepted', 'submitting', 'uncertain', 'rejected') OR remote_job_id IS NOT NULL
    ),
    ADD CONSTRAINT reason_when_uncertain_or_rejected CHECK (
        state NOT IN ('uncertain', 'rejected') OR reason IS NOT NULL
    ),
    ADD CONSTRAINT polled_only_while_pollable CHECK (
        next_poll_at IS NULL OR state IN ('submitted', 'queued', 'running')
    );
DROP TYPE operation_state_with_stalled;

CREATE INDEX operations_due_polls ON operations (next_poll_at)
    WHERE state IN ('submitted', 'queued', 'running');
CREATE INDEX operations_submitting ON operations (updated_at) WHERE state = 'submitting';
CREATE INDEX operations_state ON operations (state);
CREATE TRIGGER operations_log_transition AFTER INSERT OR UPDATE OF state ON operations
    FOR EACH ROW EXECUTE FUNCTION operations_log_transition();
