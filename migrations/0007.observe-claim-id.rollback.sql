-- Observer claims go back to being recognised by the poll claim alone.
ALTER TABLE operations DROP COLUMN observe_claim_id;
