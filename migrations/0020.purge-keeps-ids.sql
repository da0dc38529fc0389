-- `streams purge` keeps each purged operation's row as the guard of its id, with the request, source, last
-- observation and reason erased and purged_at set (queries/retention.sql purge_batch): deleting the row let a
-- replayed or re-driven submission with the same id be accepted again as a new operation and POSTed a second time.
-- Its transitions, outputs, outbox rows and callback deliveries are still deleted.
-- depends: 0019.worker-transitions

ALTER TABLE operations ADD COLUMN purged_at timestamptz;
COMMENT ON COLUMN operations.purged_at IS
    'When streams purge erased the operation (its request, source, last observation and reason, and deleted its '
    'transitions, outputs and outbox rows); NULL while it is whole. The row stays: the guard against a replay of its id.';
