-- The state "the job is known but the provider's answers stopped making progress". Added alone: PostgreSQL
-- lets a new enum value be used only after the transaction that added it commits (0002.2 uses it).
-- depends: 0001.ledger

ALTER TYPE operation_state ADD VALUE 'stalled';
