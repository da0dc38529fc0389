"""The worker's wall clock measured against PostgreSQL's: at start and every ``clock_check_interval_s``, logged
(a WARNING past ``clock_skew_warn_s``) and exported as ``streams_clock_skew_seconds``.

Nothing the fleet decides rests on a worker's wall clock (docs/provider-edges.md, "Time from its source": leases
and deadlines are monotonic, schedules the database's ``now()``, the rate budget Redis's ``TIME``, a
``Retry-After`` date the answer's ``Date``); the skew tells an operator how far this worker's own timestamps (log
lines, dead letters' ``failed_at_ms``) are off, and a large one that its host's time service is broken.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import asyncpg

from streams import metrics
from streams.config import Settings
from streams.errors import LedgerUnavailableError
from streams.ledger.snapshot import ClockOffset, read_clock_offset

log = logging.getLogger(__name__)

#: Longest wait (s) for one measurement (a connection of the pool and its readings); past it the measurement is
#: skipped until the next interval.
CLOCK_CHECK_TIMEOUT_S = 5.0


def skew_log_level(skew_s: float, warn_s: float, previous: ClockOffset | None) -> int | None:
    """The level of the log line of a measured ``skew_s`` (s) given the warning threshold ``warn_s`` (s) and the
    ``previous`` measurement (None: this is the first): WARNING past the threshold (every time), INFO for the
    first measurement and for one back within the threshold after a WARNING, else None (no line)."""
    if abs(skew_s) > warn_s:
        return logging.WARNING
    if previous is None or abs(previous.skew_s) > warn_s:
        return logging.INFO
    return None


class ClockCheck:
    """Measures this worker's clock (``clock``: seconds since the epoch, default ``time.time``) against the
    database's on ``pool`` (:meth:`check`), logs and exports it."""

    def __init__(self, pool: asyncpg.Pool, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        self.pool = pool
        self.settings = settings
        self.clock = clock
        #: The last measurement (None before the first that succeeded).
        self.latest: ClockOffset | None = None

    async def check(self) -> ClockOffset | None:
        """One measurement, bounded by :data:`CLOCK_CHECK_TIMEOUT_S`: the gauge set, a log line as
        :func:`skew_log_level` says; None (logged, the gauge kept) when PostgreSQL did not answer. Never raises
        for an outage."""
        try:
            async with asyncio.timeout(CLOCK_CHECK_TIMEOUT_S):
                reading = await read_clock_offset(self.pool, clock=self.clock)
        except (LedgerUnavailableError, TimeoutError) as exc:
            log.warning(
                "could not measure this worker's clock against PostgreSQL's (tried again in %.0f s): %s",
                self.settings.clock_check_interval_s,
                str(exc) or f"no answer within {CLOCK_CHECK_TIMEOUT_S} s",
            )
            return None
        metrics.CLOCK_SKEW_SECONDS.set(reading.skew_s)
        level = skew_log_level(reading.skew_s, self.settings.clock_skew_warn_s, self.latest)
        if level is not None:
            log.log(
                level,
                "this worker's clock is %+.3f s off PostgreSQL's (round trip %.3f s; warning past %.1f s, "
                "STREAMS_CLOCK_SKEW_WARN_S)%s",
                reading.skew_s,
                reading.round_trip_s,
                self.settings.clock_skew_warn_s,
                "; its log lines' and dead letters' timestamps are off by as much" if level >= logging.WARNING else "",
            )
        self.latest = reading
        return reading

    async def run(self) -> None:
        """:meth:`check` now and every ``clock_check_interval_s`` seconds, until cancelled."""
        while True:
            await self.check()
            await asyncio.sleep(self.settings.clock_check_interval_s)
