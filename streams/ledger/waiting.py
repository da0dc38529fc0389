"""Waiting out PostgreSQL outages inside the ledger's statements, for callers that must not drop their work.

A ledger given an :class:`OutageWait` (the worker's: :class:`streams.worker.runtime.Runtime`) runs each statement
marked :func:`waits_out_outages` until it does not raise :class:`LedgerUnavailableError`: the first attempt runs
bare (no retry machinery while PostgreSQL answers), the second follows at once (a connection the restart broke is
replaced by a fresh one), then tenacity waits with capped exponential backoff and jitter (0.1 s doubling, plus up
to 1 s, at most ``retry_cap_s``) until ``deadline_s`` after the second attempt, and raises the last error. Every
failed attempt goes to ``on_retry(what, error)`` (the worker counts it in
``streams_ledger_unavailable_total{what}`` and logs it). Any other exception is raised at once. A ledger without
one (the operators' commands) raises the outage to its caller.

A statement that may be repeated this way is safe to repeat: its caller's ids (claim id, call id) stay the same
through the repeats, so a repeat of a statement committed before its reply was lost returns what it wrote.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

import tenacity

from streams.errors import LedgerUnavailableError
from streams.retrying import failure_of

P = ParamSpec("P")
T = TypeVar("T")

#: Seconds a statement waits out a PostgreSQL outage before it gives up (from its second attempt).
LEDGER_OUTAGE_DEADLINE_S = 600.0

#: The backoff's multiplier (s): the first wait after the second failed attempt is this plus jitter, then doubles.
FIRST_WAIT_S = 0.1


class OutageWait:
    """How a ledger waits out an outage: the backoff's cap (s), the deadline (s) and who hears of each retry."""

    def __init__(
        self,
        *,
        retry_cap_s: float,
        on_retry: Callable[[str, BaseException], None],
        deadline_s: float | None = None,
    ) -> None:
        self.retry_cap_s = retry_cap_s
        self.on_retry = on_retry
        self.deadline_s = deadline_s

    async def run(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``await fn()`` until it does not raise :class:`LedgerUnavailableError` (module docstring).

        Raises:
            LedgerUnavailableError: the outage outlasted the deadline (the last attempt's error).
        """
        try:
            return await fn()  # the fast path: no retry machinery unless PostgreSQL is actually down
        except LedgerUnavailableError as exc:
            self.on_retry(what, exc)
        deadline_s = LEDGER_OUTAGE_DEADLINE_S if self.deadline_s is None else self.deadline_s
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(LedgerUnavailableError),
            wait=tenacity.wait_exponential_jitter(multiplier=FIRST_WAIT_S, max=self.retry_cap_s),
            stop=tenacity.stop_after_delay(deadline_s),
            reraise=True,
            before_sleep=lambda rs: self.on_retry(what, failure_of(rs) or LedgerUnavailableError(what)),
        )
        async for attempt in retrying:
            with attempt:
                return await fn()
        raise AssertionError("unreachable")  # pragma: no cover


class WaitsOutOutages:
    """A ledger whose marked statements wait out outages once :meth:`wait_out_outages` gave it a policy."""

    outage_wait: OutageWait | None = None

    def wait_out_outages(self, wait: OutageWait | None) -> None:
        """Wait out outages with ``wait`` from now on (None: raise them to the caller)."""
        self.outage_wait = wait


L = TypeVar("L", bound=WaitsOutOutages)

#: A ledger's statement: an ``async def`` method.
Statement = Callable[Concatenate[L, P], Coroutine[Any, Any, T]]


def waits_out_outages(
    what: str,
) -> Callable[[Statement[L, P, T]], Statement[L, P, T]]:
    """Mark a ledger statement as waited out under the name ``what`` (the metric's label, the log line's words)."""

    def decorate(statement: Statement[L, P, T]) -> Statement[L, P, T]:
        @functools.wraps(statement)
        async def waiting(self: L, /, *args: P.args, **kwargs: P.kwargs) -> T:
            wait = self.outage_wait
            if wait is None:
                return await statement(self, *args, **kwargs)
            return await wait.run(what, lambda: statement(self, *args, **kwargs))

        return waiting

    return decorate
