ALTER TABLE operations ALTER COLUMN request TYPE jsonb USING (
    request::jsonb || jsonb_strip_nulls(jsonb_build_object('submitted_at_ms', submitted_at_ms, 'source', source::jsonb))
);

ALTER TABLE operations DROP COLUMN source, DROP COLUMN submitted_at_ms;
