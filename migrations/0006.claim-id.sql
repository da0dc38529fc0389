-- Writes a caller may send again after losing the reply (the connection dropped after PostgreSQL committed them)
-- carry an id the caller chose, so that the repeat recognises what the first one wrote:
-- * a dispatcher's claim (accepted -> submitting) records its claim id; the repeat finds it on the row and gets
--   its fencing value back, instead of "past accepted" (which would leave the operation without its POST);
-- * an accounting row of a remote call records its call id; the repeat writes no second row for one call.
-- depends: 0005.accepted-index

ALTER TABLE operations ADD COLUMN claim_id uuid;
COMMENT ON COLUMN operations.claim_id IS
    'the id of the dispatcher claim that moved the operation to submitting (streams/ledger/queries/ledger.sql claim_for_submit)';

ALTER TABLE remote_calls ADD COLUMN call_id uuid;
CREATE UNIQUE INDEX remote_calls_call_id ON remote_calls (call_id);
COMMENT ON COLUMN remote_calls.call_id IS
    'the id the caller gave this accounting row (streams/ledger/queries/ledger.sql record_remote_call); NULL before 0006';
