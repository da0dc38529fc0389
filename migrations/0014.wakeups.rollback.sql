-- Back to 0012: outbox inserts no longer notify (relays find rows by their fallback timer).
DROP TRIGGER IF EXISTS outbox_notify ON outbox;
DROP FUNCTION IF EXISTS outbox_notify();
