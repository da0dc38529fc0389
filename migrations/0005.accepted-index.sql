-- The index on every operation's state goes: its only reader was the search for operations left 'accepted'
-- (stale_accepted), which a partial index on updated_at serves as operations_submitting does for 'submitting'.
-- Operations past 'accepted' leave it, so the five updates that follow acceptance no longer write an index entry
-- each into it, and no batched claim can be planned as a scan of every accepted operation through it.
-- depends: 0004.poll-backpressure

CREATE INDEX operations_accepted ON operations (updated_at) WHERE state = 'accepted';
DROP INDEX operations_state;
