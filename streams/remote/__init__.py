"""The remote generation API: the client (one POST per operation, GETs of a job, answers classified into
:mod:`streams.model.answers`) over its HTTP transport. May import :mod:`streams.model`, :mod:`streams.wire`
and the foundation modules; never the ledger or Redis.
"""
