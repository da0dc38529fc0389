DROP TABLE remote_calls;
DROP TABLE outbox;
DROP TABLE outputs;
DROP TABLE transitions;
DROP TABLE operations;
DROP FUNCTION operations_guard();
DROP TABLE operation_state_transitions;
DROP TYPE operation_state;
