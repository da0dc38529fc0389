-- Back to 0008. The records of erasures and re-drives go with their tables; the reference of remote_jobs to
-- operations comes back NOT VALID (jobs of purged operations stay, unchecked; new rows are checked).
REVOKE DELETE ON operations, transitions, outputs, outbox FROM streams_operator;
REVOKE UPDATE (payload) ON outputs, outbox FROM streams_operator;
DROP TRIGGER transitions_delete_terminal_only ON transitions;
DROP TRIGGER operations_delete_terminal_only ON operations;
DROP FUNCTION refuse_delete_unless_terminal();
ALTER TABLE remote_jobs ADD CONSTRAINT remote_jobs_operation_id_fkey
    FOREIGN KEY (operation_id) REFERENCES operations (operation_id) NOT VALID;
DROP TABLE dead_letter_redrives;
DROP TABLE erasures;
