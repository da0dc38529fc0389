-- `streams purge --ids-older-than` deletes the row kept for a purged id once no record can bring the id back
-- (docs/operating-data.md "The kept ids"). A replay that comes after the purge (a producer's resend, a consumer group
-- set back) is dead-lettered and written to the submissions and dead-letter topics again, starting their retention
-- anew: replayed_at records the last one, and the horizon counts from greatest(purged_at, replayed_at).
-- A freed id must not carry anything of its former operation to a new one: the operator role may delete its
-- cancellation (which would cancel the new operation before its POST).
-- depends: 0020.purge-keeps-ids

ALTER TABLE operations ADD COLUMN replayed_at timestamptz;
COMMENT ON COLUMN operations.replayed_at IS
    'When a submission with the id of this erased operation (forgotten or purged) last came and was dead-lettered; '
    'NULL when none came. streams purge --ids-older-than keeps the row until both this and purged_at are old enough.';

GRANT DELETE ON cancellations TO streams_operator;
