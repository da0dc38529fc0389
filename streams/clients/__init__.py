"""The applications' side of the topics: the upstream submission client (``streams submit``,
:mod:`streams.clients.submit`) and the downstream follower of delivered outputs (``streams follow``,
:mod:`streams.clients.follow`). May import :mod:`streams.wire` and the foundation modules.
"""
