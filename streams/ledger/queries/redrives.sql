-- Named queries of re-driven dead letters (loaded by streams.ledger.sql.Queries; called by streams.ledger.redrives):
-- `streams dead-letters redrive` compares a re-driven submission with the request the ledger holds, and records
-- each re-drive (table dead_letter_redrives, migration 0009).

-- name: operation_request
-- :operation_id. The request the ledger holds for the operation, as JSON text (one row or none): request.
SELECT request::text AS request FROM operations WHERE operation_id = :operation_id;

-- name: posts_of
-- :operation_id. How many POSTs the accounting recorded for the id (kept when streams purge --ids-older-than deletes
-- the operation's row: a former operation of the id was sent to the provider).
SELECT count(*)::integer AS posts FROM remote_calls WHERE operation_id = :operation_id AND method = 'POST';

-- name: record_redrive
-- One re-drive: the dead letter (:dead_letter_topic, :dead_letter_partition, :dead_letter_offset,
-- :dead_letter_reason), the operation it names (:operation_id, or NULL), where it was published again
-- (:target_topic, :target_partition, :target_offset), :value_source ('original' or 'file'), :value_sha256 (hex),
-- :why and :actor. Returns id, at.
INSERT INTO dead_letter_redrives (
    dead_letter_topic, dead_letter_partition, dead_letter_offset, dead_letter_reason, operation_id,
    target_topic, target_partition, target_offset, value_source, value_sha256, why, actor)
VALUES (
    :dead_letter_topic, :dead_letter_partition, :dead_letter_offset, :dead_letter_reason, :operation_id,
    :target_topic, :target_partition, :target_offset, :value_source, :value_sha256, :why, :actor)
RETURNING id, at;

-- name: redrives_of
-- :dead_letter_topic, :dead_letter_partitions (integer[]), :dead_letter_offsets (bigint[], paired with the
-- partitions). Every re-drive of those dead letters, oldest first: dead_letter_partition, dead_letter_offset,
-- operation_id, target_topic, target_partition, target_offset, value_source, value_sha256, why, actor, at.
SELECT r.dead_letter_partition, r.dead_letter_offset, r.operation_id, r.target_topic, r.target_partition,
       r.target_offset, r.value_source, r.value_sha256, r.why, r.actor, r.at
FROM dead_letter_redrives r
JOIN unnest(:dead_letter_partitions::integer[], :dead_letter_offsets::bigint[]) AS k (p, o)
  ON r.dead_letter_partition = k.p AND r.dead_letter_offset = k.o
WHERE r.dead_letter_topic = :dead_letter_topic
ORDER BY r.id;
