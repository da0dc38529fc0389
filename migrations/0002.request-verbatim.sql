-- The provider's request is kept as the JSON text the application sent: json, not jsonb (jsonb re-orders keys,
-- writes exponents out in digits and refuses a "\u0000" escape). When it was submitted and where it came from,
-- stored inside the request until now, get columns of their own.
-- depends: 0001.ledger

ALTER TABLE operations ADD COLUMN submitted_at_ms bigint, ADD COLUMN source json;

UPDATE operations
SET submitted_at_ms = (request->>'submitted_at_ms')::numeric::bigint,
    source = (request->'source')::json
WHERE request ? 'submitted_at_ms' OR request ? 'source';

ALTER TABLE operations ALTER COLUMN request TYPE json USING (request - 'submitted_at_ms' - 'source')::json;

COMMENT ON COLUMN operations.request IS
    'The provider request body exactly as submitted (JSON text); the POST adds metadata.client_reference and a default model';
