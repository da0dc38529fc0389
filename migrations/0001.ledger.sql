-- The ledger: operations, their transition log, outputs with the outbox, and remote-call accounting.
-- depends:

CREATE TYPE operation_state AS ENUM (
    'accepted', 'submitting', 'submitted', 'queued', 'running',
    'succeeded', 'failed', 'canceled', 'uncertain', 'rejected'
);

-- Legal forward moves; mirrored by streams.model.states._ALLOWED (a test compares them).
CREATE TABLE operation_state_transitions (
    from_state operation_state NOT NULL,
    to_state   operation_state NOT NULL,
    PRIMARY KEY (from_state, to_state)
);

INSERT INTO operation_state_transitions (from_state, to_state) VALUES
    ('accepted', 'submitting'),
    ('submitting', 'submitted'), ('submitting', 'rejected'), ('submitting', 'uncertain'),
    ('uncertain', 'submitted'),
    ('submitted', 'queued'), ('submitted', 'running'),
    ('submitted', 'succeeded'), ('submitted', 'failed'), ('submitted', 'canceled'),
    ('queued', 'running'), ('queued', 'succeeded'), ('queued', 'failed'), ('queued', 'canceled'),
    ('running', 'succeeded'), ('running', 'failed'), ('running', 'canceled');

CREATE TABLE operations (
    operation_id        text PRIMARY KEY,
    state               operation_state NOT NULL DEFAULT 'accepted',
    request             jsonb NOT NULL,
    remote_job_id       text UNIQUE,
    fencing_token       bigint NOT NULL DEFAULT 0 CHECK (fencing_token >= 0),
    next_poll_at        timestamptz,
    poll_claim_id       bigint NOT NULL DEFAULT 0,
    poll_count          integer NOT NULL DEFAULT 0,
    last_observation    jsonb,
    last_observed_at    timestamptz,
    reason              text,
    remote_completed_at timestamptz,
    accepted_at         timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    updated_by          text NOT NULL,
    CONSTRAINT job_id_once_submitted CHECK (
        state IN ('accepted', 'submitting', 'uncertain', 'rejected') OR remote_job_id IS NOT NULL
    ),
    CONSTRAINT reason_when_uncertain_or_rejected CHECK (
        state NOT IN ('uncertain', 'rejected') OR reason IS NOT NULL
    ),
    CONSTRAINT polled_only_while_pollable CHECK (
        next_poll_at IS NULL OR state IN ('submitted', 'queued', 'running')
    )
);

CREATE INDEX operations_due_polls ON operations (next_poll_at)
    WHERE state IN ('submitted', 'queued', 'running');
CREATE INDEX operations_submitting ON operations (updated_at) WHERE state = 'submitting';
CREATE INDEX operations_state ON operations (state);

-- Refuse illegal transitions, fencing regressions and job-id rewrites whatever the query says.
CREATE FUNCTION operations_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IS DISTINCT FROM OLD.state AND NOT EXISTS (
        SELECT 1 FROM operation_state_transitions t
        WHERE t.from_state = OLD.state AND t.to_state = NEW.state
    ) THEN
        RAISE EXCEPTION 'illegal transition % -> % for operation %', OLD.state, NEW.state, OLD.operation_id
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.fencing_token < OLD.fencing_token THEN
        RAISE EXCEPTION 'fencing token of operation % would go back from % to %',
            OLD.operation_id, OLD.fencing_token, NEW.fencing_token USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.remote_job_id IS NOT NULL AND NEW.remote_job_id IS DISTINCT FROM OLD.remote_job_id THEN
        RAISE EXCEPTION 'remote job id of operation % is saved and never changes', OLD.operation_id
            USING ERRCODE = 'check_violation';
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END
$$;

CREATE TRIGGER operations_guard BEFORE UPDATE ON operations
    FOR EACH ROW EXECUTE FUNCTION operations_guard();

-- Every accepted state change, in order.
CREATE TABLE transitions (
    id            bigserial PRIMARY KEY,
    operation_id  text NOT NULL REFERENCES operations (operation_id),
    from_state    operation_state,
    to_state      operation_state NOT NULL,
    fencing_token bigint NOT NULL,
    reason        text,
    worker        text NOT NULL,
    at            timestamptz NOT NULL DEFAULT now(),
    UNIQUE (operation_id, to_state)
);

CREATE TABLE outputs (
    operation_id text NOT NULL REFERENCES operations (operation_id),
    output_id    text NOT NULL,
    position     integer NOT NULL,
    payload      jsonb NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (operation_id, output_id)
);

-- Transactional outbox: rows are written with the state change and published by the relay.
CREATE TABLE outbox (
    id                bigserial PRIMARY KEY,
    event_id          text NOT NULL UNIQUE,
    topic_role        text NOT NULL CHECK (topic_role IN ('outputs_delivered', 'transitions')),
    operation_id      text NOT NULL REFERENCES operations (operation_id),
    output_id         text,
    payload           jsonb NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    published_at      timestamptz,
    CONSTRAINT output_rows_name_their_output CHECK ((topic_role = 'outputs_delivered') = (output_id IS NOT NULL))
);

CREATE UNIQUE INDEX outbox_one_row_per_output ON outbox (operation_id, output_id) WHERE output_id IS NOT NULL;
CREATE INDEX outbox_unpublished ON outbox (id) WHERE published_at IS NULL;

-- Remote-call accounting: one row per POST or GET attempt, with its classified outcome.
CREATE TABLE remote_calls (
    id            bigserial PRIMARY KEY,
    operation_id  text NOT NULL,
    method        text NOT NULL CHECK (method IN ('POST', 'GET')),
    status_code   integer,
    outcome       text NOT NULL,
    remote_job_id text,
    duration_ms   double precision NOT NULL,
    fencing_token bigint,
    worker        text NOT NULL,
    at            timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX remote_calls_operation ON remote_calls (operation_id);

-- Every state change is logged by the database itself, in the same transaction as the change: one row in
-- the transition log and one outbox event for generation.transitions (event id transition:<op>:<state>,
-- deterministic because each state is entered at most once). No query can change state without it.
CREATE FUNCTION operations_log_transition() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    previous operation_state;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.state IS NOT DISTINCT FROM OLD.state THEN
            RETURN NULL;
        END IF;
        previous := OLD.state;
    END IF;
    INSERT INTO transitions (operation_id, from_state, to_state, fencing_token, reason, worker)
    VALUES (NEW.operation_id, previous, NEW.state, NEW.fencing_token, NEW.reason, NEW.updated_by);
    INSERT INTO outbox (event_id, topic_role, operation_id, payload)
    VALUES (
        'transition:' || NEW.operation_id || ':' || NEW.state,
        'transitions',
        NEW.operation_id,
        jsonb_build_object(
            'event_id', 'transition:' || NEW.operation_id || ':' || NEW.state,
            'operation_id', NEW.operation_id,
            'from_state', previous,
            'to_state', NEW.state,
            'fencing_token', NEW.fencing_token,
            'remote_job_id', NEW.remote_job_id,
            'reason', NEW.reason,
            'at_ms', floor(extract(epoch FROM now()) * 1000)::bigint));
    RETURN NULL;
END
$$;

CREATE TRIGGER operations_log_transition AFTER INSERT OR UPDATE OF state ON operations
    FOR EACH ROW EXECUTE FUNCTION operations_log_transition();
