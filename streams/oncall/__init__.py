"""What the people on call read and decide: the operators' listings, details, decisions and accounting
(:mod:`streams.oncall.operations`, used by ``streams operations`` and ``streams accounting``) and the live
view's pages (:mod:`streams.oncall.liveview`, served by a worker). May import the ledger, coordination and
the layers below; never the worker at run time.
"""
