-- Named queries of the accounting: what the provider was asked, what it created, what it charged and refunded.
-- Loaded by streams.ledger.sql.Queries; called by streams.ledger.store.Ledger. Amounts are numeric and leave as text (exact).

-- name: accounting_summary
-- :operation_pattern operation id LIKE pattern ('%' for the whole ledger). One row of jsonb columns:
--   jobs_by_outcome {outcome | 'not_terminal': n}, jobs_by_learned_via {via: n},
--   learned_only_via_502 n, duplicate_creations n,
--   charges [{currency, amount, jobs}], refunds_settled [{currency, amount, refunds}],
--   refunds_pending n (jobs that failed or were canceled with a charge and no refund recorded),
--   needs_decision {state: {operations, oldest_age_s}} for uncertain and stalled,
--   posts_per_operation {operations, mean, max}, gets_per_completed_operation {operations, mean, max} (of the
--   operations held, since their acceptance: the former calls of a freed id are left out),
--   created_after_decision {jobs n, unobserved n, first [{operation_id, remote_job_id, state}] (the unobserved,
--   oldest first, at most 20)}: jobs a POST answer reported after an operator decided the operation.
WITH jobs AS (
    SELECT * FROM remote_jobs WHERE operation_id LIKE :operation_pattern
), calls AS (  -- the former calls of a freed id (before the acceptance of the operation holding it, or none held) apart
    SELECT c.operation_id,
           (o.operation_id IS NULL OR c.at < o.accepted_at) AS former,
           count(*) FILTER (WHERE c.method = 'POST') AS posts,
           count(*) FILTER (WHERE c.method = 'GET') AS gets
    FROM remote_calls c LEFT JOIN operations o USING (operation_id)
    WHERE c.operation_id LIKE :operation_pattern
    GROUP BY 1, 2
), completed AS (
    SELECT o.operation_id, COALESCE(c.gets, 0) AS gets
    FROM operations o LEFT JOIN calls c ON c.operation_id = o.operation_id AND NOT c.former
    WHERE o.operation_id LIKE :operation_pattern AND o.state IN ('succeeded', 'failed', 'canceled')
)
SELECT
    (SELECT COALESCE(jsonb_object_agg(outcome, n), '{}'::jsonb)
     FROM (SELECT COALESCE(outcome, 'not_terminal') AS outcome, count(*) AS n FROM jobs GROUP BY 1) AS x)
        AS jobs_by_outcome,
    (SELECT COALESCE(jsonb_object_agg(learned_via, n), '{}'::jsonb)
     FROM (SELECT learned_via, count(*) AS n FROM jobs GROUP BY 1) AS x)
        AS jobs_by_learned_via,
    (SELECT count(*) FROM jobs WHERE learned_via = 'post_502')::integer AS learned_only_via_502,
    (SELECT count(*) FROM jobs WHERE learned_via = 'duplicate')::integer AS duplicate_creations,
    (SELECT COALESCE(jsonb_agg(jsonb_build_object('currency', currency, 'amount', amount::text, 'jobs', n)
                               ORDER BY currency), '[]'::jsonb)
     FROM (SELECT COALESCE(charge_currency, '?') AS currency, sum(charge_amount) AS amount, count(*) AS n
           FROM jobs WHERE charge IS NOT NULL GROUP BY 1) AS x)
        AS charges,
    (SELECT COALESCE(jsonb_agg(jsonb_build_object('currency', currency, 'amount', amount::text, 'refunds', n)
                               ORDER BY currency), '[]'::jsonb)
     FROM (SELECT COALESCE(r.currency, '?') AS currency, sum(r.amount) AS amount, count(*) AS n
           FROM refunds r JOIN jobs j USING (remote_job_id) GROUP BY 1) AS x)
        AS refunds_settled,
    (SELECT count(*) FROM jobs j
     WHERE j.outcome IN ('failed', 'canceled') AND j.charge_amount > 0
       AND NOT EXISTS (SELECT 1 FROM refunds r WHERE r.remote_job_id = j.remote_job_id))::integer
        AS refunds_pending,
    (SELECT jsonb_object_agg(s.state, jsonb_build_object(
                'operations', COALESCE(x.n, 0),
                'oldest_age_s', x.oldest_age_s))
     FROM (VALUES ('uncertain'), ('stalled')) AS s(state)
     LEFT JOIN (SELECT state::text AS state, count(*) AS n,
                       round(extract(epoch FROM now() - min(state_entered_at))::numeric, 1)::float8 AS oldest_age_s
                FROM operations
                WHERE operation_id LIKE :operation_pattern AND state IN ('uncertain', 'stalled')
                GROUP BY 1) AS x USING (state))
        AS needs_decision,
    (SELECT jsonb_build_object('operations', count(*), 'mean', round(avg(posts), 3)::float8, 'max', max(posts))
     FROM calls WHERE posts > 0 AND NOT former)
        AS posts_per_operation,
    (SELECT jsonb_build_object('operations', count(*), 'mean', round(avg(gets), 3)::float8, 'max', max(gets))
     FROM completed)
        AS gets_per_completed_operation,
    (SELECT jsonb_build_object(
                'jobs', count(*),
                'unobserved', count(*) FILTER (WHERE o.operation_id IS NOT NULL
                                                 AND o.remote_job_id IS DISTINCT FROM j.remote_job_id),
                'first', COALESCE((
                    SELECT jsonb_agg(jsonb_build_object('operation_id', x.operation_id,
                                                        'remote_job_id', x.remote_job_id, 'state', x.state)
                                     ORDER BY x.learned_at, x.remote_job_id)
                    FROM (SELECT lj.operation_id, lj.remote_job_id, lo.state::text AS state, lj.learned_at
                          FROM jobs lj JOIN operations lo USING (operation_id)
                          WHERE lj.learned_via = 'created_after_decision'
                            AND lo.remote_job_id IS DISTINCT FROM lj.remote_job_id
                          ORDER BY lj.learned_at, lj.remote_job_id
                          LIMIT 20) AS x), '[]'::jsonb))
     -- an operation whose id streams purge --ids-older-than deleted had no late job: its jobs still count
     FROM jobs j LEFT JOIN operations o USING (operation_id)
     WHERE j.learned_via = 'created_after_decision')
        AS created_after_decision;

-- name: record_refund
-- A refund the provider reported for a job, recorded once per (refund id, job id): a repeat inserts nothing.
-- Never consulted to decide whether a job was created.
-- :remote_job_id, :refund (jsonb with a string "id", and "amount", "currency" as sent). Returns 1 when
-- recorded now, no row when it was already (or the job has no accounting record).
INSERT INTO refunds (refund_id, remote_job_id, refund, amount, currency)
SELECT :refund::jsonb ->> 'id',
       j.remote_job_id,
       :refund::jsonb,
       CASE WHEN :refund::jsonb ->> 'amount' ~ '^-?[0-9]{1,30}(\.[0-9]{1,30})?$' THEN (:refund::jsonb ->> 'amount')::numeric END,
       left(:refund::jsonb ->> 'currency', 16)
FROM remote_jobs j
WHERE j.remote_job_id = :remote_job_id AND jsonb_typeof(:refund::jsonb -> 'id') = 'string'
ON CONFLICT (refund_id, remote_job_id) DO NOTHING
RETURNING 1;
