-- Back to free-text outcomes and reasons; the renamed values are kept (they are still readable text).
ALTER TABLE remote_calls DROP CONSTRAINT remote_calls_outcome_known;
DROP TABLE remote_call_outcomes;
ALTER TABLE operations DROP COLUMN reason_code;
DROP TABLE reason_codes;
