"""Coordination in Redis: the per-operation lease (owner token, TTL, fencing token), the coalescing Redis stage
that pipelines the lease's scripts, and the shared rate budget toward the provider. May import
:mod:`streams.model`, :mod:`streams.wire` and the foundation modules; never the ledger or the remote client.
"""
