-- Cancellation (docs/cancellation.md): an application (topic generation.cancellations) or an operator
-- (`streams operations cancel`) asks that an operation be canceled.
-- * cancellations: one row per operation asked to be canceled (the first ask; a repeat is a no-op): who, why, by
--   which path, when, and the state the operation was in (NULL: not yet in the ledger). Kept across restarts; the
--   dispatcher's claim and the observer's claim read it under the operation's row lock.
-- * accepted -> canceled (mirrored by streams.model.states): before the claim nothing was sent, so the operation
--   ends canceled and no POST is ever sent.
-- * operations: the provider's cancel route called for the job: the attempts, the classified answer and when it
--   came (cancel_answered_at: a definite answer, never called again).
-- * remote calls of the cancel route are accounted with method 'CANCEL' and their own outcomes.
-- depends: 0011.retention

CREATE TABLE cancellations (
    operation_id     text PRIMARY KEY,  -- no reference: a cancel may arrive before its submission
    path             text NOT NULL CHECK (path IN ('topic', 'operator')),
    actor            text NOT NULL CHECK (btrim(actor) <> ''),
    reason           text NOT NULL CHECK (btrim(reason) <> ''),
    state_when_asked operation_state,
    asked_at         timestamptz NOT NULL DEFAULT now()
);

INSERT INTO operation_state_transitions (from_state, to_state) VALUES ('accepted', 'canceled');

INSERT INTO reason_codes (reason_code) VALUES ('canceled_before_submit');

INSERT INTO remote_call_outcomes (outcome) VALUES
    ('cancel_accepted'), ('cancel_already_terminal'), ('cancel_not_found'), ('cancel_refused'),
    ('cancel_unknown_outcome');

ALTER TABLE remote_calls DROP CONSTRAINT remote_calls_method_check;
ALTER TABLE remote_calls ADD CONSTRAINT remote_calls_method_check CHECK (method IN ('POST', 'GET', 'CANCEL'));

-- A job id is saved in every state after submitting, except canceled before the submit (nothing was sent).
ALTER TABLE operations
    DROP CONSTRAINT job_id_once_submitted,
    ADD CONSTRAINT job_id_once_submitted CHECK (
        state IN ('accepted', 'submitting', 'uncertain', 'rejected') OR remote_job_id IS NOT NULL
        OR (state = 'canceled' AND reason_code = 'canceled_before_submit')
    );

ALTER TABLE operations
    ADD COLUMN cancel_attempts integer NOT NULL DEFAULT 0 CHECK (cancel_attempts >= 0),
    ADD COLUMN cancel_outcome text CHECK (cancel_outcome IS NULL OR cancel_outcome LIKE 'cancel\_%'),  -- a remote_calls outcome
    ADD COLUMN cancel_answered_at timestamptz;

GRANT SELECT ON cancellations TO streams_worker, streams_operator, streams_readonly;
GRANT INSERT ON cancellations TO streams_worker, streams_operator;
