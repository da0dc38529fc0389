-- Back to the index on every operation's state.
CREATE INDEX operations_state ON operations (state);
DROP INDEX operations_accepted;
