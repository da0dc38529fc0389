-- `streams purge` keeps each purged operation's row as the guard of its id, with the request, source, last
-- observation and reason erased and purged_at set (queries/retention.sql purge_batch): deleting the row let a
-- replayed or re-driven submission with the same id be accepted again as a new operation and POSTed a second time.
-- Its transitions, outputs, outbox rows and callback deliveries are still deleted.
-- depends: 0019.worker-transitions

ALTER TABLE operations ADD COLUMN purged_at timestamptz;
COMMENT ON COLUMN operations.purged_at IS
    'When streams purge erased the operation (its request, source, last observation and reason, and deleted its '
    'transitions, outputs and outbox rows); NULL while it is whole. The row stays: the guard against a replay of its id.';

-- What a purge looks for: terminal operations not purged yet, oldest first (without it each batch read every kept row).
CREATE INDEX operations_purgeable ON operations (state_entered_at, operation_id)
    WHERE purged_at IS NULL AND state IN ('succeeded', 'failed', 'canceled', 'rejected');

-- A purged operation that changes state again (a late job adopted: docs/decisions.md) is no longer counted as purged
-- (its erased request and deleted rows stay so), so a later purge takes what it wrote since.
CREATE FUNCTION operations_unpurge() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.purged_at := NULL;
    RETURN NEW;
END
$$;
CREATE TRIGGER operations_unpurge BEFORE UPDATE OF state ON operations
    FOR EACH ROW WHEN (OLD.purged_at IS NOT NULL AND NEW.state IS DISTINCT FROM OLD.state)
    EXECUTE FUNCTION operations_unpurge();
