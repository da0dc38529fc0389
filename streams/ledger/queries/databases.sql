-- Named queries about the databases of the server (loaded by streams.ledger.sql.Queries; called by
-- streams.ledger.databases).

-- name: database_exists
-- :name. True when the server holds a database of that name.
SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = :name);
