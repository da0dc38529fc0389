-- Wake-ups (docs/operations.md, "Wake-ups"): every statement that inserts output rows into the outbox
-- (topic_role 'outputs_delivered') notifies channel streams_outbox (streams.ledger.notices.OUTBOX_CHANNEL) in its
-- own transaction, so the notification is delivered when, and only if, the rows commit; PostgreSQL folds the
-- identical notifications of one transaction into one. Workers LISTEN on it to wake their outbox relay. Rows of
-- transitions alone do not notify (each would wake every worker's relay for one small round): they go with the
-- next round, at the latest the relay's fallback; a lost notification likewise only delays a row.
-- depends: 0013.callbacks

CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM inserted WHERE topic_role = 'outputs_delivered') THEN
        PERFORM pg_notify('streams_outbox', '');
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON outbox REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
