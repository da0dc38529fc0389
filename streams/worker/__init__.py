"""The worker: the Faust app as composition root (:mod:`streams.worker.app`), the process and its restarts
(:mod:`streams.worker.process`), the runtime holding the shared clients (:mod:`streams.worker.runtime`),
in-order acknowledgement of consumed events (:mod:`streams.worker.inflight`) and the pipeline's stages
(:mod:`streams.worker.stages`). May import every package below :mod:`streams.cli`.
"""
