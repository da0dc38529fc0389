-- Explicit codes beside free text: the outcome of each remote call is one of a fixed list (mirrored by
-- streams.model.codes.RemoteCallOutcome), kept in a reference table the accounting rows point to; values written
-- before are renamed to it (class-name spellings, raw provider status words). Likewise an operation's
-- reason gets a machine code beside it (streams.model.codes.ReasonCode): both set or both empty; reasons written
-- before carry 'unclassified'.
-- depends: 0002.2.reconciliation

CREATE TABLE remote_call_outcomes (
    outcome text PRIMARY KEY
);
INSERT INTO remote_call_outcomes (outcome) VALUES
    ('created'), ('created_via_502'), ('refused'), ('rate_limited'), ('not_sent'), ('unknown_outcome'),
    ('queued'), ('running'), ('succeeded'), ('failed'), ('canceled'),
    ('job_not_found'), ('unknown_status'), ('contract_violation'), ('transient'), ('abandoned'),
    ('lookup_found_0'), ('lookup_found_1'), ('lookup_found_2'), ('lookup_found_3'), ('lookup_found_4'),
    ('lookup_found_5'), ('lookup_found_6'), ('lookup_found_7'), ('lookup_found_8'), ('lookup_found_9'),
    ('lookup_refused'), ('lookup_rate_limited'), ('lookup_contract_violation'), ('lookup_transient');

UPDATE remote_calls SET outcome = CASE lower(btrim(outcome))
    WHEN 'ratelimited' THEN 'rate_limited'
    WHEN 'notsent' THEN 'not_sent'
    WHEN 'unknownoutcome' THEN 'unknown_outcome'
    WHEN 'contract' THEN 'contract_violation'
    WHEN 'jobnotfound' THEN 'job_not_found'
    WHEN 'unknownstatus' THEN 'unknown_status'
    WHEN 'pending' THEN 'queued'
    WHEN 'in_progress' THEN 'running'
    WHEN 'completed' THEN 'succeeded'
    WHEN 'cancelled' THEN 'canceled'
    WHEN 'lookup_ratelimited' THEN 'lookup_rate_limited'
    WHEN 'lookup_contract' THEN 'lookup_contract_violation'
    WHEN 'lookup_abandoned' THEN 'lookup_transient'
    WHEN 'lookup_notsent' THEN 'lookup_transient'
    WHEN 'lookup_unknownoutcome' THEN 'lookup_transient'
    ELSE lower(btrim(outcome))
END
WHERE outcome NOT IN (SELECT outcome FROM remote_call_outcomes);

ALTER TABLE remote_calls
    ADD CONSTRAINT remote_calls_outcome_known FOREIGN KEY (outcome) REFERENCES remote_call_outcomes (outcome);

CREATE TABLE reason_codes (
    reason_code text PRIMARY KEY
);
INSERT INTO reason_codes (reason_code) VALUES
    ('unclassified'), ('job_id_via_error'), ('refused'), ('rate_limited'), ('not_sent'), ('unknown_outcome'),
    ('job_id_not_saved'), ('no_outcome_saved'), ('not_found_by_lookup'), ('adopted_by_lookup'),
    ('remote_job_failed'), ('max_age'), ('job_not_found'), ('unknown_status'),
    ('adopted_by_operator'), ('abandoned_by_operator'), ('repolled_by_operator'), ('failed_by_operator');

ALTER TABLE operations ADD COLUMN reason_code text REFERENCES reason_codes (reason_code);
UPDATE operations SET reason_code = 'unclassified' WHERE reason IS NOT NULL;
ALTER TABLE operations
    ADD CONSTRAINT reason_code_with_reason CHECK ((reason IS NULL) = (reason_code IS NULL));
