-- Failed polls of a job in a row (an answer that cannot be used, a timeout, a lost connection, a 429): each
-- counts toward the job's backoff (poll_count) and STREAMS_FAILED_POLL_LIMIT of them in a row end in 'stalled'
-- with reason code 'poll_failures'. An answer with a known status ends the run.
-- depends: 0008.roles

ALTER TABLE operations
    ADD COLUMN failed_poll_count integer NOT NULL DEFAULT 0 CHECK (failed_poll_count >= 0);
COMMENT ON COLUMN operations.failed_poll_count IS
    'failed polls in a row (streams/ledger/queries/ledger.sql note_failed_poll); 0 after a usable answer';
INSERT INTO reason_codes (reason_code) VALUES ('poll_failures');
