"""Waits without a deadline for what only time fixes (Redis unavailable, a lease another holder has): tenacity,
with the first attempt made outside it.

tenacity's machinery costs tens of µs a call (about 30 µs for one successful attempt on a 2-core machine), paid
by every call it wraps; on the hot paths (a lease taken per event, a rate budget slot per POST, a renewal per
call) the first attempt is a plain call, so only a call that failed pays for the retry policy. The first failure
is the policy's first attempt (reported and waited after like any other): the calls and the waits are those
tenacity alone would make.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import tenacity

T = TypeVar("T")


def failure_of(state: tenacity.RetryCallState) -> BaseException | None:
    """The exception the attempt behind ``state`` raised (None if it returned)."""
    return state.outcome.exception() if state.outcome is not None else None


async def retry_without_deadline(
    fn: Callable[[], Awaitable[T]],
    *,
    retry_on: type[BaseException] | tuple[type[BaseException], ...],
    wait: tenacity.wait.wait_base | Callable[[tenacity.RetryCallState], float],
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Call ``fn`` until it returns; after each failure of a type in ``retry_on``, report it to ``on_retry`` (count
    it, log it), then sleep as ``wait`` says (a tenacity wait such as ``wait_exponential``, or a function of the
    retry state returning seconds) and call again. No deadline: only a result, another exception or a
    cancellation (during a call or a sleep) ends it.

    Raises:
        whatever ``fn`` raises outside ``retry_on`` (at once); ``CancelledError`` when cancelled.
    """

    def retrying() -> tenacity.AsyncRetrying:  # built only after a failed first attempt
        return tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(retry_on),
            wait=wait,
            before_sleep=None if on_retry is None else lambda state: on_retry(_failure(state)),
            reraise=True,
        )

    return await first_attempt_plain(fn, retrying, retry_on)


async def first_attempt_plain(
    fn: Callable[[], Awaitable[T]],
    retrying: tenacity.AsyncRetrying | Callable[[], tenacity.AsyncRetrying],
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = Exception,
) -> T:
    """``fn()`` under ``retrying`` (a tenacity policy, or a function making one), with the first attempt made as
    a plain call: the policy is built and entered only when that attempt raised one of ``retry_on``, and that
    failure then counts as the policy's first attempt (its stop, wait and callbacks see it as tenacity alone
    would). Anything else the first attempt raises propagates at once.

    Raises:
        whatever the policy finally raises (``reraise=True`` policies: ``fn``'s last exception).
    """
    try:
        return await fn()  # the fast path: no retry machinery unless the first attempt failed
    except retry_on as exc:
        pending = [exc]
    policy = retrying if isinstance(retrying, tenacity.AsyncRetrying) else retrying()
    async for attempt in policy:
        with attempt:
            if pending:  # the first attempt's failure, as if tenacity had made that attempt
                raise pending.pop()
            return await fn()
    raise AssertionError("unreachable")  # pragma: no cover


def _failure(state: tenacity.RetryCallState) -> BaseException:
    failure = failure_of(state)
    assert failure is not None, "tenacity sleeps only after a failed attempt here"
    return failure
