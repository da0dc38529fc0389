DROP TRIGGER operations_unpurge ON operations;
DROP FUNCTION operations_unpurge();
DROP INDEX operations_purgeable;
ALTER TABLE operations DROP COLUMN purged_at;
