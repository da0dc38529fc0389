-- Retention, erasure and re-driven dead letters (docs/operating-data.md "Retention and erasure", "Dead letters"):
-- * erasures: one row per `streams operations forget`: whose request, source and outputs were erased, why, by whom;
-- * dead_letter_redrives: one row per dead letter re-driven by `streams dead-letters redrive`: which record, where
--   it was published again, whether the original or a fixed value, why, by whom;
-- * the accounting outlives a purge: remote_jobs no longer references operations (remote_calls and refunds never
--   did), so `streams purge` deletes a terminal operation with its transitions, outputs and outbox rows and keeps
--   what the provider was asked, created, charged and refunded;
-- * a guard: an operation and its transition log are deleted only once it is terminal, whoever deletes;
-- * streams_operator (0008) may do what purge and forget need, nothing more: delete the rows of terminal operations,
--   update the payload columns of outputs and outbox, insert the two records. It still rewrites no log row.
-- depends: 0010.late-answers

CREATE TABLE erasures (
    id             bigserial PRIMARY KEY,
    operation_id   text NOT NULL,    -- no reference: the record outlives a purge of the operation
    reason         text NOT NULL CHECK (btrim(reason) <> ''),
    actor          text NOT NULL CHECK (btrim(actor) <> ''),
    outputs_erased integer NOT NULL CHECK (outputs_erased >= 0),
    at             timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX erasures_operation ON erasures (operation_id);

CREATE TABLE dead_letter_redrives (
    id                 bigserial PRIMARY KEY,
    dead_letter_topic  text NOT NULL,
    dead_letter_partition integer NOT NULL CHECK (dead_letter_partition >= 0),
    dead_letter_offset bigint NOT NULL CHECK (dead_letter_offset >= 0),
    dead_letter_reason text NOT NULL,
    operation_id       text,          -- the re-driven value's, when it names one
    target_topic       text NOT NULL,
    target_partition   integer NOT NULL CHECK (target_partition >= 0),
    target_offset      bigint NOT NULL CHECK (target_offset >= 0),
    value_source       text NOT NULL CHECK (value_source IN ('original', 'file')),
    value_sha256       text NOT NULL CHECK (value_sha256 ~ '^[0-9a-f]{64}$'),
    why                text NOT NULL CHECK (btrim(why) <> ''),
    actor              text NOT NULL CHECK (btrim(actor) <> ''),
    at                 timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dead_letter_redrives_record
    ON dead_letter_redrives (dead_letter_topic, dead_letter_partition, dead_letter_offset);

ALTER TABLE remote_jobs DROP CONSTRAINT remote_jobs_operation_id_fkey;

CREATE FUNCTION refuse_delete_unless_terminal() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM operations o
        WHERE o.operation_id = OLD.operation_id
          AND o.state NOT IN ('succeeded', 'failed', 'canceled', 'rejected')
    ) THEN
        RAISE EXCEPTION 'operation % is not terminal: its rows are kept (%)', OLD.operation_id, TG_TABLE_NAME
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN OLD;
END
$$;

CREATE TRIGGER operations_delete_terminal_only BEFORE DELETE ON operations
    FOR EACH ROW EXECUTE FUNCTION refuse_delete_unless_terminal();
CREATE TRIGGER transitions_delete_terminal_only BEFORE DELETE ON transitions
    FOR EACH ROW EXECUTE FUNCTION refuse_delete_unless_terminal();

GRANT SELECT ON erasures, dead_letter_redrives TO streams_worker, streams_operator, streams_readonly;
GRANT INSERT ON erasures, dead_letter_redrives TO streams_operator;
GRANT USAGE ON SEQUENCE erasures_id_seq, dead_letter_redrives_id_seq TO streams_operator;
GRANT DELETE ON operations, transitions, outputs, outbox TO streams_operator;
GRANT UPDATE (payload) ON outputs, outbox TO streams_operator;
