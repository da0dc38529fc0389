-- Transitions written by a worker do not notify (docs/operations.md, "Wake-ups"): the worker that wrote them wakes
-- its own outbox relay in-process (streams.ledger.written), and announces on its way out what its relay may have
-- left; a notification of them only woke every other worker's listener (one transaction on each listening
-- backend per notification read) for a round that found them already published. A worker's connections are
-- named application_name 'streams-worker...' (streams.ledger.connect_options.application_name); transitions from any
-- other connection (the operators' commands, another client, a worker of an earlier version) still notify
-- 'transitions', and outputs notify 'outputs' from every connection, as in 0016.
-- depends: 0018.callback-hints

CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM inserted WHERE topic_role = 'outputs_delivered') THEN
        PERFORM pg_notify('streams_outbox', 'outputs');
    ELSIF EXISTS (SELECT 1 FROM inserted)
          AND coalesce(current_setting('application_name', true), '') NOT LIKE 'streams-worker%' THEN
        PERFORM pg_notify('streams_outbox', 'transitions');
    END IF;
    RETURN NULL;
END;
$$;
