-- Run outside a transaction too (yoyo applies the migration's own `transactional: false` to its rollback). yoyo pairs
-- this file's statements with the migration's in reverse order (the last here undoes the first there) and runs the
-- undo of the steps already done when one fails: one statement here per statement there. A rollback interrupted while
-- it rebuilt outbox_one_row_per_output leaves it invalid (IF NOT EXISTS then keeps it): drop it and roll back again.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS outbox_one_row_per_output ON outbox (operation_id, output_id)
    WHERE output_id IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS outbox_operation_output;
SELECT 'nothing to undo: the leftover dropped was a failed build';
DROP INDEX CONCURRENTLY IF EXISTS operations_purged;
SELECT 'nothing to undo: the leftover dropped was a failed build';
