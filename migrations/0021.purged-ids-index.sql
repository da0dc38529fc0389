-- `streams purge --ids-older-than` deletes the kept row of each id purged longer ago than a horizon (queries/
-- retention.sql forget_ids_batch), oldest purge first: this index finds them without reading every row of the
-- table. Built CONCURRENTLY (outside a transaction): writes to operations go on while it builds; a build that
-- failed leaves an invalid index, which the rollback drops.
-- depends: 0020.purge-keeps-ids
-- transactional: false

CREATE INDEX CONCURRENTLY IF NOT EXISTS operations_purged ON operations (purged_at, operation_id)
    WHERE purged_at IS NOT NULL;
