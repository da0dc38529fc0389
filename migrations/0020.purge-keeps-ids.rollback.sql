ALTER TABLE operations DROP COLUMN purged_at;
