-- Poll back-pressure: the scheduler keeps the polls claimed and not yet taken by an observer within what the
-- observers take before the visibility timeout (streams.worker.stages.scheduler). poll_claimed_at is set by a claim and
-- cleared when an observer takes the poll (claimed and not yet taken: NOT NULL); poll_taken_at is when an
-- observer last took one (the observers' recent pace, read cluster-wide).
-- depends: 0003.explicit-codes

ALTER TABLE operations ADD COLUMN poll_claimed_at timestamptz, ADD COLUMN poll_taken_at timestamptz;
CREATE INDEX operations_polls_claimed ON operations (poll_claimed_at) WHERE poll_claimed_at IS NOT NULL;
CREATE INDEX operations_polls_taken ON operations (poll_taken_at) WHERE poll_taken_at IS NOT NULL;
