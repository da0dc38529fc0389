-- Run outside a transaction too (yoyo applies the migration's own `transactional: false` to its rollback).
DROP INDEX CONCURRENTLY IF EXISTS outbox_one_row_per_output;
CREATE UNIQUE INDEX CONCURRENTLY outbox_one_row_per_output ON outbox (operation_id, output_id)
    WHERE output_id IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS outbox_operation_output;
DROP INDEX CONCURRENTLY IF EXISTS operations_purged;
