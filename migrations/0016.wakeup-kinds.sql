-- Wake-ups by kind (docs/operations.md, "Wake-ups"): the outbox trigger's notification on channel streams_outbox
-- names what a statement inserted: payload 'outputs' when any row is an output (topic_role 'outputs_delivered'),
-- else 'transitions'. A relay wakes at once for outputs and within STREAMS_WAKEUP_FALLBACK_S for transitions
-- (coalesced: one round for every transition of that second), so its fallback timer can be long while it listens
-- (STREAMS_WAKEUP_LISTENING_FALLBACK_S). PostgreSQL folds the identical notifications of one transaction into one.
-- depends: 0014.wakeups

CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM inserted WHERE topic_role = 'outputs_delivered') THEN
        PERFORM pg_notify('streams_outbox', 'outputs');
    ELSIF EXISTS (SELECT 1 FROM inserted) THEN
        PERFORM pg_notify('streams_outbox', 'transitions');
    END IF;
    RETURN NULL;
END;
$$;
