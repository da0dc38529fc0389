"""generation-streams: an event-driven stream processor for remote generation jobs.

Applications submit generation requests to Kafka; workers POST each once to a remote generation API,
observe the remote job under a short Redis lease until it is terminal, record every fenced transition in
the PostgreSQL ledger, and deliver outputs downstream exactly once through a transactional outbox.
See ``README.md``.
"""

__version__ = "0.1.0"
