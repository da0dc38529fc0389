-- transactional: false

DROP INDEX CONCURRENTLY IF EXISTS operations_purged;
