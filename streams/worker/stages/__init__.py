"""The pipeline's stages, each a handler of one kind of work: the dispatcher (submission -> one POST), the
observer (a due poll -> one GET under the lease), the stalled-job rule, the poll scheduler, the reconciler
of ``uncertain`` operations and the outbox relay. May import :mod:`streams.worker.runtime` and the packages
below the worker; never the app or the process.
"""
