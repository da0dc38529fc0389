REVOKE DELETE ON cancellations FROM streams_operator;
ALTER TABLE operations DROP COLUMN replayed_at;
