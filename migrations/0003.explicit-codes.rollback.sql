-- Back to free-text outcomes; the renamed values are kept (they are still readable text).
ALTER TABLE remote_calls DROP CONSTRAINT remote_calls_outcome_known;
DROP TABLE remote_call_outcomes;
