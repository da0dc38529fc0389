"""Telling a worker that a ledger statement wrote transitions, so that its own outbox relay publishes them.

A worker's transitions notify no other worker (migration ``0019.worker-transitions``: its connections are named
``streams-worker``, :func:`streams.ledger.connect_options.application_name`, and the outbox trigger skips theirs).
A statement marked :func:`writes_transitions` calls the ledger's ``on_transitions_written`` once it returned or
raised (a statement whose reply was lost may have committed); the worker then wakes its relay within
``STREAMS_WAKEUP_FALLBACK_S`` (:meth:`streams.worker.runtime.Runtime.transitions_written`). A statement can write a
transition when its SQL inserts an operation or sets an operation's ``state`` (the trigger
``operations_log_transition`` then writes the outbox row); ``tests/unit/test_transitions_hook.py`` reads that from
the SQL and checks the marks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

#: The attribute :func:`writes_transitions` sets on the statements it marks (read by the tests).
TRANSITIONS_MARK = "__writes_transitions__"


class AnnouncesTransitions:
    """A ledger whose marked statements call ``on_transitions_written`` (None: nobody listens)."""

    on_transitions_written: Callable[[], None] | None = None


A = TypeVar("A", bound=AnnouncesTransitions)


def writes_transitions(
    statement: Callable[Concatenate[A, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[A, P], Coroutine[Any, Any, T]]:
    """Mark a ledger statement as one that may write transitions: ``on_transitions_written()`` follows each call,
    whether it returned or raised."""

    @functools.wraps(statement)
    async def announcing(self: A, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await statement(self, *args, **kwargs)
        finally:
            hook = self.on_transitions_written
            if hook is not None:
                hook()

    setattr(announcing, TRANSITIONS_MARK, True)
    return announcing
