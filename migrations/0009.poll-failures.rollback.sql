-- Failed polls are no longer counted; an operation stalled for them keeps its reason as unclassified.
UPDATE operations SET reason_code = 'unclassified' WHERE reason_code = 'poll_failures';
DELETE FROM reason_codes WHERE reason_code = 'poll_failures';
ALTER TABLE operations DROP COLUMN failed_poll_count;
