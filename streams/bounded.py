"""Awaits bounded in time where a library leaves them without limit.

Two rules of the project, both for CPython 3.11:

* A timeout is ``async with asyncio.timeout(t)``, never ``asyncio.wait_for``: 3.11's ``wait_for`` returns the inner
  result when its task is cancelled just as the inner awaitable finishes (CPython gh-86296, fixed in 3.12), so a
  loop cancelled at that moment goes on and whoever waits for it never ends (a unit test keeps ``wait_for`` out
  of ``streams/``).
* A probe's answer (``/readyz``) goes through :func:`answer_within`, which does not wait for the question's cancel.
* A client's close (aiokafka's ``stop``/``close``, which flush or wait for every connection to close; aiohttp's
  connector) goes through :func:`close_within`: after the operation it served gave up, its close must give up too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Longest a worker's shutdown waits for one of its parts to finish or close (s): its ledger loops after their
#: cancel, the ledger's pool, the provider's HTTP client. Past it the part is closed under what still runs (or left
#: behind), with a WARNING.
CLOSE_TIMEOUT_S = 10.0


async def answer_within(asking: Awaitable[T], timeout_s: float) -> T:
    """The result of ``asking`` if it comes within ``timeout_s`` seconds; else ``TimeoutError`` at once, ``asking``
    cancelled but not waited for (a probe's answer: ``asyncio.timeout`` waits for the cancel to finish, and asyncpg's
    cancel of a statement on a frozen server takes as long as its connect timeout). Its own exceptions propagate."""
    task = asyncio.ensure_future(asking)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except BaseException:  # cancelled meanwhile: so is the question
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)  # its late end (CancelledError or an error) is not an unretrieved one
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    return task.result()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def close_within(closing: Awaitable[object], timeout_s: float, what: str) -> bool:
    """Await ``closing`` (a client's close) at most ``timeout_s`` seconds; True when it finished, False (a WARNING
    naming ``what``) when it was cut off. An exception of the close itself propagates."""
    bound = asyncio.timeout(timeout_s)
    try:
        async with bound:
            await closing
    except TimeoutError:
        if not bound.expired():  # the close's own error
            raise
        log.warning("%s did not close within %g s; left behind", what, timeout_s)
        return False
    return True
