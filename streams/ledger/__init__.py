"""The ledger in PostgreSQL, the only package that speaks SQL to it: the connection pool and the diagnosis of
connection failures, the batching of the pipeline's fenced statements, operators' decisions, accounting, the
read-only views, and the query loader with its named queries in ``queries/*.sql``. May import
:mod:`streams.model`, :mod:`streams.wire` and the foundation modules; never Redis, Kafka or the remote client.
"""
