-- Back to 0014: only outputs notify, with an empty payload.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM inserted WHERE topic_role = 'outputs_delivered') THEN
        PERFORM pg_notify('streams_outbox', '');
    END IF;
    RETURN NULL;
END;
$$;
