"""Starting one worker process: wait for the services, then run Faust; start again when one of them went away
while Faust was starting.

A worker started beside services that are (re)starting must not exit: the process supervisor (systemd,
Kubernetes, honcho) would otherwise see a crash where there was only a wait. aiokafka tries its bootstrap servers
once (``AIOKafkaClient.bootstrap`` raises ``KafkaConnectionError``), and Faust stops the worker when a service it
starts raises. So:

1. before Faust starts anything, :class:`StreamsWorker` waits until PostgreSQL, Redis and Kafka answer real
   commands (:func:`streams.setup.readiness.wait_ready`), for at most ``STREAMS_STARTUP_TIMEOUT_S``; past it, the
   process exits with status 5 (``EXIT_UNAVAILABLE``, as every ``streams`` command) and one line naming the
   service;
2. a service can still go away between that check and Faust's own connections (a broker restarting in that
   window). A start-up failure that is an outage (:func:`streams.outages.is_outage`) before every service of the
   worker started makes :func:`run_worker` start the process again in place (``exec`` of the same command line,
   same pid), at most :data:`MAX_START_ATTEMPTS` times in a row; anything else (a bug, a refused setting) ends the
   process as before, a wrong setting (:class:`streams.errors.ConfigError`: PostgreSQL refusing the login, no such
   database, a URL the client refuses) with exit status 6 as every ``streams`` command, so a supervisor can tell
   it from a crash (systemd: ``RestartPreventExitStatus=6``);
3. once started, a worker rides out outages itself (see :mod:`streams.outages` for what waits), but Faust stops
   the whole worker when one of its own services crashes, and some of its calls to the broker are beyond this
   code's reach. A crash whose reason is an outage also starts the process again in place (unless the worker
   had been told to stop: SIGTERM, SIGINT). Such crashes count as start-up attempts while they come within
   :data:`STABLE_UPTIME_S` of the start; a crash later than that begins a new series (the crash is its first
   attempt). A broker that keeps crashing workers just after they start thus ends them after
   :data:`MAX_START_ATTEMPTS`, while a worker that meets an outage once a week never runs out of attempts.

A started worker also calls ``gc.freeze()``: what was made while starting stays out of the cyclic collector's full
collections; and it collects its young objects less often (:data:`GC_THRESHOLDS`). Both measured with ``streams
bench``: CHANGELOG.md.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import faust

from streams import hooks
from streams.config import Settings
from streams.errors import EXIT_CONFIG, EXIT_UNAVAILABLE, ConfigError, ServiceNotReadyError, error_summary
from streams.hooks import HookPoint
from streams.outages import is_outage
from streams.setup.readiness import SERVICES, wait_ready

log = logging.getLogger(__name__)

#: How many times in a row one worker process starts when services go away during its start-up.
MAX_START_ATTEMPTS = 5
#: A worker crashed by an outage after running this long (since Faust reported it started) begins a new series
#: of start attempts; a crash sooner counts as one more attempt of the current series.
STABLE_UPTIME_S = 60.0
#: The cyclic garbage collector's thresholds once a worker has started (``gc.set_threshold``; CPython 3.11's
#: defaults are 700, 10, 10): a young collection once 5,000 more container objects were made than freed, the older
#: generations as by default. A worker under load keeps many objects alive for a while (each event's frames,
#: futures, rows), so at 700 young collections come often and each moves live objects along; most of them are freed
#: by their last reference before 5,000 more are made (figures: CHANGELOG.md). The cost is memory held by cyclic
#: garbage: an event whose handling raised leaves a cycle (its exception, traceback and frames, which hold its
#: value, up to ``max_value_bytes``) that waits for the next young collection, about seven times as many such
#: cycles as at 700, and longer when one was moved to an older generation while its retries waited. The meaning of
#: the thresholds is CPython 3.11-3.13's.
GC_THRESHOLDS = (5_000, 10, 10)
#: Environment variable carrying the attempt number across ``exec`` (set by this module only).
START_ATTEMPT_ENV = "STREAMS_WORKER_START_ATTEMPT"


class StreamsWorker(faust.Worker):
    """faust's :class:`faust.Worker` that waits for the services before it starts Faust's own, and remembers a
    start-up failure (:attr:`startup_failure`) and when it started (:attr:`started_monotonic`) so that
    :func:`run_worker` can tell an outage from a bug, and a crash soon after the start from a later one.

    ``settings`` gives the services' addresses and ``startup_timeout_s``; the other arguments are faust's.
    """

    def __init__(self, app: faust.App, settings: Settings, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.settings = settings
        #: The exception that stopped the worker before it had started, if any.
        self.startup_failure: BaseException | None = None
        #: ``time.monotonic()`` when Faust reported the worker started; None before.
        self.started_monotonic: float | None = None

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
        self.started_monotonic = time.monotonic()
        # Everything made while starting (modules, the app, its clients) lives as long as the process: keep it out
        # of the cyclic garbage collector's full collections, which otherwise walk all of it again and again. The
        # garbage the start-up left (cycles of refused connections' exceptions and frames) is collected first: a
        # frozen object is never collected again. Then young objects are collected less often (GC_THRESHOLDS).
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        hooks.reach(HookPoint.WORKER_STARTED, worker=self)
        await super().on_started()  # mode's worker (a daemon) waits here until it stops

    async def start(self) -> None:
        try:
            await super().start()
        except ServiceNotReadyError as exc:
            # Not a crash: one line naming the service instead of Faust's traceback; the start is cancelled (mode's
            # worker then shuts down quietly) and run_worker exits with EXIT_UNAVAILABLE.
            self.startup_failure = exc
            log.error("streams worker stopped: a service did not answer: %s", exc)
            raise asyncio.CancelledError from exc
        except BaseException as exc:
            if self.started_monotonic is None:
                self.startup_failure = exc
            raise

    @property
    def failure(self) -> BaseException | None:
        """What stopped the worker: the start-up failure, else the reason Faust crashed it; None for a clean stop
        (SIGTERM, SIGINT)."""
        return self.startup_failure if self.startup_failure is not None else self.crash_reason

    def _schedule_shutdown(self, signal: Any) -> None:
        """mode's worker on SIGTERM or SIGINT; the first one also starts the stop's deadline
        (:class:`StopDeadline`, ``stop_timeout_s``)."""
        if self._signal_stop_time is None:
            StopDeadline(self.settings.stop_timeout_s).start()
        super()._schedule_shutdown(signal)

    @property
    def stop_requested(self) -> bool:
        """True once the worker was told to stop (SIGTERM, SIGINT): whatever fails after that, it must not start
        again. (mode's worker notes the signal's time in ``_signal_stop_time``.)"""
        return self._signal_stop_time is not None

    def uptime_s(self) -> float:
        """Seconds since Faust reported the worker started; 0.0 if it never did."""
        return 0.0 if self.started_monotonic is None else time.monotonic() - self.started_monotonic


class StopDeadline:
    """Ends the process ``timeout_s`` after a stop began if it is still running: faust's stop waits without limit
    for the events in hand (``stream_wait_empty``, which wait out an outage), the producer's flush and the consumer's
    leaving its group, so with Kafka frozen a stopped worker ran until Kafka came back. Past the deadline: one ERROR
    line and ``os._exit`` with ``EXIT_UNAVAILABLE``, in a thread of its own (the event loop may be the one stuck).
    Nothing is lost: an event not handled is not committed (the partition's next owner handles it), leases expire,
    and outbox rows not marked are published again with their event ids.

    ``exit`` replaces ``os._exit`` in tests."""

    def __init__(self, timeout_s: float, exit: Callable[[int], object] = os._exit) -> None:
        self.timeout_s = timeout_s
        self._exit = exit
        self._timer = threading.Timer(timeout_s, self._overdue)
        self._timer.daemon = True  # a process that ends in time is not held back by it

    def start(self) -> None:
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()

    def _overdue(self) -> None:
        log.error(
            "streams worker did not stop within %g s (STREAMS_STOP_TIMEOUT_S: a service not answering); exiting "
            "now: events not handled are not committed, their partitions' next owner handles them",
            self.timeout_s,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(EXIT_UNAVAILABLE)


def next_attempt(failure: BaseException | None, attempt: int, uptime_s: float = 0.0) -> int | None:
    """The attempt number (from 1) to start again with, for a worker on its ``attempt``-th start that stopped with
    ``failure`` (``None``: stopped cleanly) after running ``uptime_s`` seconds since Faust reported it started
    (0.0: during start-up); None when the process should end instead.

    Only an outage (:func:`streams.outages.is_outage`) starts again: as ``attempt + 1``, or as 2 after a crash
    at least :data:`STABLE_UPTIME_S` into the run (a new series, the crash its first attempt); never beyond
    :data:`MAX_START_ATTEMPTS`.
    """
    if failure is None or not is_outage(failure):
        return None
    following = 2 if uptime_s >= STABLE_UPTIME_S else attempt + 1
    return following if following <= MAX_START_ATTEMPTS else None


def run_worker(app: faust.App, settings: Settings, **kwargs: Any) -> None:
    """Run ``app`` in a :class:`StreamsWorker` until it stops; exit the process as Faust does. A start-up outage
    (see the module) starts the same command line again in this process (``os.execv``), its attempt number in
    ``STREAMS_WORKER_START_ATTEMPT``.

    Raises:
        SystemExit: always: Faust's exit status, ``EXIT_CONFIG`` (6, :mod:`streams.errors`) when a wrong
            setting stopped the worker, ``EXIT_UNAVAILABLE`` (5) when a service did not answer within
            ``startup_timeout_s`` (one log line, no traceback) or outages used up the start attempts.
    """
    attempt = int(os.environ.get(START_ATTEMPT_ENV, "1"))
    worker = StreamsWorker(app, settings, **kwargs)
    try:
        worker.execute_from_commandline()
    except SystemExit:
        failure = worker.failure
        following = None if worker.stop_requested else next_attempt(failure, attempt, worker.uptime_s())
        if following is None:
            if isinstance(failure, ConfigError):  # logged by Faust ("Error: ..."); not a crash to restart after
                raise SystemExit(EXIT_CONFIG) from failure
            if isinstance(failure, ServiceNotReadyError) or (failure is not None and is_outage(failure)):
                raise SystemExit(EXIT_UNAVAILABLE) from failure  # as every ``streams`` command (streams.cli)
            raise
        when = "while this worker started" if worker.started_monotonic is None else "and crashed this worker"
        log.warning(
            "a service went away %s (%s); starting again (attempt %d of %d)",
            when,
            error_summary(failure) if failure is not None else "no reason given",
            following,
            MAX_START_ATTEMPTS,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.environ[START_ATTEMPT_ENV] = str(following)
        os.execv(sys.executable, sys.orig_argv)
