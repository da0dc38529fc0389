-- An observer's claim of a poll records the id its caller chose for it. A claim sent again because its reply was
-- lost (the connection dropped after PostgreSQL committed it) finds its own id on the row and gets its claim back,
-- instead of "poll already taken" (which would leave the job unpolled until the poll's visibility timeout).
-- depends: 0006.claim-id

ALTER TABLE operations ADD COLUMN observe_claim_id uuid;
COMMENT ON COLUMN operations.observe_claim_id IS
    'the id of the latest observer claim of a poll (streams/ledger/queries/ledger.sql claim_for_observe)';
