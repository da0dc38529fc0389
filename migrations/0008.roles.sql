-- Least-privilege group roles (NOLOGIN): a deployment grants them to its login roles (docs/operating-data.md
-- "Roles"), e.g. CREATE ROLE worker_1 LOGIN PASSWORD '...' IN ROLE streams_worker.
-- * streams_worker: what the pipeline writes. The transition log (transitions) and the accounting rows
--   (remote_calls, refunds) can be inserted and read, never updated or deleted; remote_jobs is updated (a job's
--   outcome as it is learned), never deleted; operations, outputs and outbox rows are never deleted.
-- * streams_operator: the operators' commands (streams operations ..., accounting report, dead letters): the
--   worker's rights on operations and remote_jobs (the decisions are fenced UPDATEs and the adopted job's
--   accounting record), and reading everything; never a rewrite of the transition log.
-- * streams_readonly: SELECT on every table (dashboards, the live view's reads, audits).
-- Roles belong to the server, not to one database: each is created when missing, so every database migrated on
-- one server shares them; the grants are this database's. Tables created by later migrations grant their own.
-- depends: 0007.observe-claim-id

DO $roles$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'streams_worker') THEN
        CREATE ROLE streams_worker NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'streams_operator') THEN
        CREATE ROLE streams_operator NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'streams_readonly') THEN
        CREATE ROLE streams_readonly NOLOGIN;
    END IF;
END
$roles$;

GRANT USAGE ON SCHEMA public TO streams_worker, streams_operator, streams_readonly;

GRANT SELECT ON operation_state_transitions, remote_call_outcomes, reason_codes,
    operations, transitions, outputs, outbox, remote_calls, remote_jobs, refunds
    TO streams_worker, streams_operator, streams_readonly;

GRANT INSERT, UPDATE ON operations, outbox TO streams_worker;
GRANT INSERT ON outputs, transitions, remote_calls, remote_jobs, refunds TO streams_worker;
GRANT UPDATE ON remote_jobs TO streams_worker;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO streams_worker;

-- A decision's UPDATE fires the triggers that append to the transition log and the outbox (as the caller).
GRANT UPDATE ON operations TO streams_operator;
GRANT INSERT ON transitions, outbox, remote_jobs TO streams_operator;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO streams_operator;
