-- The worker's periodic snapshot (streams.ledger.snapshot): a few aggregates, read every
-- web_snapshot_interval_s by each worker, for its gauges and the live view.

-- name: state_figures
-- Operations by state with the age of the oldest in each (s, on the database's clock); states without
-- operations are absent. Returns state, operations, oldest_age_s.
SELECT state::text AS state, count(*)::integer AS operations,
       extract(epoch FROM now() - min(state_entered_at))::float8 AS oldest_age_s
FROM operations
GROUP BY 1;

-- name: outbox_figures
-- Outbox rows not yet published and the age of the oldest (s; NULL when none), from the partial index
-- outbox_unpublished. Returns unpublished, oldest_age_s.
SELECT count(*)::integer AS unpublished,
       extract(epoch FROM now() - min(created_at))::float8 AS oldest_age_s
FROM outbox
WHERE published_at IS NULL;

-- name: ping
-- Whether PostgreSQL answers (the readiness probe). Returns 1.
SELECT 1;

-- name: clock_now
-- The database's wall clock at the moment the statement runs (clock_timestamp(), not the transaction's now()),
-- in seconds since the Unix epoch with microseconds: what a worker measures its own clock against
-- (streams.ledger.snapshot.read_clock_offset). Returns one float8.
SELECT extract(epoch FROM clock_timestamp())::float8;
