-- Back to unbounded poll claims: the columns' indexes go with them.
ALTER TABLE operations DROP COLUMN poll_taken_at, DROP COLUMN poll_claimed_at;
