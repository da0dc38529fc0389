"""Starting one worker process: wait for the services, then run Faust; start again when one of them went away
while Faust was starting.

A worker started beside services that are (re)starting must not exit: the process supervisor (systemd,
Kubernetes, honcho) would otherwise see a crash where there was only a wait. aiokafka tries its bootstrap servers
once (``AIOKafkaClient.bootstrap`` raises ``KafkaConnectionError``), and Faust stops the worker when a service it
starts raises. So:

1. before Faust starts anything, :class:`StreamsWorker` waits until PostgreSQL, Redis and Kafka answer real
   commands (:func:`streams.readiness.wait_ready`), for at most ``STREAMS_STARTUP_TIMEOUT_S``; past it, the process
   exits non-zero naming the service;
2. a service can still go away between that check and Faust's own connections (a broker restarting in that
   window). A start-up failure that is an outage (:func:`streams.failures.is_outage`) before every service of the
   worker started makes :func:`run_worker` start the process again in place (``exec`` of the same command line,
   same pid), at most :data:`MAX_START_ATTEMPTS` times in all; anything else (a bug, a refused setting) ends the
   process as before.

Once started, a worker rides out outages itself: see :mod:`streams.failures` for what waits. It also calls
``gc.freeze()`` then: what was made while starting stays out of the cyclic collector's full collections (README,
"Benchmark": 6-20% less CPU per operation).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from typing import Any

import faust

from streams import hooks
from streams.config import Settings
from streams.failures import is_outage
from streams.hooks import HookPoint
from streams.readiness import SERVICES, wait_ready

log = logging.getLogger(__name__)

#: How many times one worker process starts in all when services go away during its start-up.
MAX_START_ATTEMPTS = 5
#: Environment variable carrying the attempt number across ``exec`` (set by this module only).
START_ATTEMPT_ENV = "STREAMS_WORKER_START_ATTEMPT"


class StreamsWorker(faust.Worker):
    """faust's :class:`faust.Worker` that waits for the services before it starts Faust's own, and remembers a
    start-up failure (:attr:`startup_failure`) so that :func:`run_worker` can tell an outage from a bug.

    ``settings`` gives the services' addresses and ``startup_timeout_s``; the other arguments are faust's.
    """

    def __init__(self, app: faust.App, settings: Settings, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.settings = settings
        #: The exception that stopped the worker before it had started, if any.
        self.startup_failure: BaseException | None = None
        self._started_fully = False

    async def on_execute(self) -> None:
        """Before any service of Faust starts: wait for PostgreSQL, Redis and Kafka.

        Raises:
            ServiceNotReadyError: a service did not answer within ``startup_timeout_s``.
        """
        await super().on_execute()
        kafka_log = logging.getLogger("aiokafka")
        level = kafka_log.level
        kafka_log.setLevel(logging.CRITICAL)  # refused connections while waiting are expected
        started = time.monotonic()
        log.info("waiting for %s (up to %.0f s)", ", ".join(SERVICES), self.settings.startup_timeout_s)
        try:
            await wait_ready(self.settings, list(SERVICES), self.settings.startup_timeout_s)
        finally:
            kafka_log.setLevel(level)
        log.info("services ready after %.1f s: %s", time.monotonic() - started, ", ".join(SERVICES))
        hooks.reach(HookPoint.SERVICES_READY_BEFORE_START)

    async def on_started(self) -> None:
        self._started_fully = True
        # Everything made while starting (modules, the app, its clients) lives as long as the process: keep it out
        # of the cyclic garbage collector's full collections, which otherwise walk all of it again and again. The
        # garbage the start-up left (cycles of refused connections' exceptions and frames) is collected first: a
        # frozen object is never collected again.
        gc.collect()
        gc.freeze()
        await super().on_started()

    async def start(self) -> None:
        try:
            await super().start()
        except BaseException as exc:
            if not self._started_fully:
                self.startup_failure = exc
            raise


def restart_after(failure: BaseException | None, attempt: int) -> bool:
    """True when a worker that stopped with ``failure`` during start-up (``None``: it started, or stopped
    cleanly) on its ``attempt``-th start (from 1) should start again: the failure is an outage and attempts
    remain (:data:`MAX_START_ATTEMPTS`)."""
    return failure is not None and is_outage(failure) and attempt < MAX_START_ATTEMPTS


def run_worker(app: faust.App, settings: Settings, **kwargs: Any) -> None:
    """Run ``app`` in a :class:`StreamsWorker` until it stops; exit the process as Faust does. A start-up outage
    (see the module) starts the same command line again in this process (``os.execv``), its attempt number in
    ``STREAMS_WORKER_START_ATTEMPT``.

    Raises:
        SystemExit: always (Faust's exit status).
    """
    attempt = int(os.environ.get(START_ATTEMPT_ENV, "1"))
    worker = StreamsWorker(app, settings, **kwargs)
    try:
        worker.execute_from_commandline()
    except SystemExit:
        failure = worker.startup_failure
        if not restart_after(failure, attempt):
            raise
        log.warning(
            "a service went away while this worker started (%s: %s); starting again (attempt %d of %d)",
            type(failure).__name__,
            failure,
            attempt + 1,
            MAX_START_ATTEMPTS,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.environ[START_ATTEMPT_ENV] = str(attempt + 1)
        os.execv(sys.executable, sys.orig_argv)
