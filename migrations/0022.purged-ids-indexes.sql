-- The indexes `streams purge --ids-older-than` needs (queries/retention.sql forget_ids_batch), built CONCURRENTLY:
-- writes go on while they build. A build that failed leaves an invalid index of the same name, and yoyo does not
-- record the migration: each index is dropped first if it exists, so running `streams migrate` again builds it anew.
-- * operations_purged: the kept rows of purged ids, oldest first by the time their horizon counts from;
-- * outbox_operation_output replaces the partial outbox_one_row_per_output (0001) with the same uniqueness (NULL
--   output ids are distinct) over every row: deleting an operation's row checks that no outbox row refers to it,
--   which without an index on operation_id read the whole outbox for each row deleted.
-- depends: 0021.replayed-ids
-- transactional: false

DROP INDEX CONCURRENTLY IF EXISTS operations_purged;
CREATE INDEX CONCURRENTLY operations_purged ON operations ((greatest(purged_at, replayed_at)), operation_id)
    WHERE purged_at IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS outbox_operation_output;
CREATE UNIQUE INDEX CONCURRENTLY outbox_operation_output ON outbox (operation_id, output_id);
DROP INDEX CONCURRENTLY IF EXISTS outbox_one_row_per_output;
