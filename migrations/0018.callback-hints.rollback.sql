-- Back to 0016: a callback during a poll is no longer remembered (its news waits for the fallback poll).
ALTER TABLE operations DROP COLUMN hinted_at;
