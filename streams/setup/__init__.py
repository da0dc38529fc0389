"""Setting the services up and checking them: migrations and topics (:mod:`streams.setup.admin`) and readiness
(:mod:`streams.setup.readiness`, ``streams ready`` and a worker's start-up wait). May import the ledger and
the layers below.
"""
