"""Named points in the pipeline where a test harness may act (fault injection); no-ops in production.

The product calls :func:`reach` at each :class:`HookPoint`. Nothing happens unless an action was installed
for that point with :func:`install`, which only the harness does (:mod:`streams_harness.faults`, run as
``python -m streams_harness.faults`` in front of the ``streams`` command line); the product reads no setting
and no environment variable for them. The idea is River's test signals (``internal/testsignal`` of
https://github.com/riverqueue/river): left uninitialised, as in production, a signal is a harmless no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any


class HookPoint(StrEnum):
    """Where the product calls :func:`reach`, and the context it passes."""

    #: The observer did its GET and renewed its lease and has not saved the result yet (only the fencing value
    #: protects the save from here on). Context: ``operation_id``.
    OBSERVED_BEFORE_SAVE = "observer.observed_before_save"
    #: The outbox relay published a batch to Kafka and has not marked it published yet. Context: ``rows``
    #: (the outbox rows, each with ``topic_role``).
    PUBLISHED_BEFORE_MARK = "relay.published_before_mark"
    #: A starting worker found every service ready and has not started Faust's own clients yet. No context.
    SERVICES_READY_BEFORE_START = "worker.services_ready_before_start"
    #: Faust reported the worker started. Context: ``worker`` (the :class:`streams.worker.process.StreamsWorker`).
    WORKER_STARTED = "worker.started"


#: An action: called with the point's context as keyword arguments.
Action = Callable[..., None]

_actions: dict[HookPoint, Action] = {}


def reach(point: HookPoint, **context: Any) -> None:
    """The product is at ``point``: run the action installed there, if any (none in production)."""
    if _actions:
        action = _actions.get(point)
        if action is not None:
            action(**context)


def install(point: HookPoint, action: Action) -> None:
    """Run ``action`` whenever the product reaches ``point`` (harness only; replaces an earlier action)."""
    _actions[point] = action


def clear() -> None:
    """Remove every installed action."""
    _actions.clear()
