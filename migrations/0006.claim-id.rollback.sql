-- Claims and accounting rows go back to being written without the caller's id.
DROP INDEX remote_calls_call_id;
ALTER TABLE remote_calls DROP COLUMN call_id;
ALTER TABLE operations DROP COLUMN claim_id;
