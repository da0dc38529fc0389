-- This database's grants to the group roles are revoked. The roles themselves stay: they belong to the server and
-- other databases migrated on it may use them (DROP ROLE by hand once none does).
REVOKE ALL ON operation_state_transitions, remote_call_outcomes, reason_codes,
    operations, transitions, outputs, outbox, remote_calls, remote_jobs, refunds
    FROM streams_worker, streams_operator, streams_readonly;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM streams_worker, streams_operator, streams_readonly;
REVOKE USAGE ON SCHEMA public FROM streams_worker, streams_operator, streams_readonly;
