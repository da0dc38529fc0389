-- Back to 0016: transitions notify from every connection.
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
