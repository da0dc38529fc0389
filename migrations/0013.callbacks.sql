-- Completion callbacks (docs/callbacks.md): each delivery the provider signed (its webhook-id) is recorded once;
-- a second delivery with the same id is a replay (acknowledged, counted, no poll). A delivery only makes the job's
-- poll due now: the saved state still comes from a GET, never from the callback's body.
-- depends: 0012.cancellation

CREATE TABLE callback_deliveries (
    webhook_id    text PRIMARY KEY CHECK (btrim(webhook_id) <> ''),
    remote_job_id text NOT NULL,
    operation_id  text NOT NULL,  -- no reference (as the other ledger records); purged with its operation
    poll_made_due boolean NOT NULL,  -- false: the poll was already due or claimed, or the job no longer pollable
    received_by   text NOT NULL,
    received_at   timestamptz NOT NULL DEFAULT now()
);

-- `streams purge` deletes an operation's deliveries with it.
CREATE INDEX callback_deliveries_operation ON callback_deliveries (operation_id);

GRANT SELECT ON callback_deliveries TO streams_worker, streams_operator, streams_readonly;
GRANT INSERT ON callback_deliveries TO streams_worker;
GRANT DELETE ON callback_deliveries TO streams_operator;  -- `streams purge` deletes them with their operations
