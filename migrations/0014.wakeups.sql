-- Wake-ups (docs/operations.md, "Wake-ups"): every statement that inserts outbox rows notifies channel
-- streams_outbox (streams.ledger.notices.OUTBOX_CHANNEL) in its own transaction, so the notification is delivered
-- when, and only if, the rows commit; PostgreSQL folds the identical notifications of one transaction into one.
-- Workers LISTEN on it to wake their outbox relay; a lost notification only delays a row to the relay's fallback.
-- depends: 0012.cancellation

CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('streams_outbox', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
