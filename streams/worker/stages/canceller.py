"""The canceller: one ``generation.cancellations`` event -> the cancellation recorded in the ledger.

:meth:`streams.ledger.store.Ledger.request_cancel` records who asked, why and when (the first ask per operation;
a replay writes nothing) and, for an operation still ``accepted``, ends it ``canceled`` under its row lock, so no
claim after it sends a POST. In every other state the record is what the rest of the pipeline reads:

* ``submitting``: the POST may be on the wire; once its job id is saved (its first poll then due at once) the
  observer calls the provider's cancel route (:mod:`streams.worker.stages.observer`) and observes the job until
  the provider reports a terminal state;
* ``submitted``/``queued``/``running``: the same, now: the statement that records the cancellation moves the job's
  poll to now under the row lock (unless already due or claimed) and this worker's poll scheduler is woken (cause
  ``cancel``), as a verified callback does; an operator's ``streams operations cancel`` makes the poll due the
  same way and a scheduler's next round (its fallback timer at most) claims it. A cancellation recorded while
  the job's poll is being observed makes the poll after it due at once;
* ``uncertain``/``stalled``: recorded; applied when the reconciler or an operator gives it a job to observe again;
* terminal: recorded, nothing changes (a job that succeeded first stays ``succeeded``, its outputs delivered);
* not in the ledger yet (the cancellation overtook its submission): recorded; the dispatcher's claim finds it and
  ends the operation ``canceled`` instead of ``submitting``.

Invalid input (not JSON, the schema, a key that is not the operation id) goes to the dead-letter topic.
docs/cancellation.md.
"""

from __future__ import annotations

import logging

from streams import logs, metrics
from streams.errors import InvalidEventError
from streams.ledger.records import CancelAsk, CancelPath
from streams.model.states import POLLABLE, OperationState, is_terminal
from streams.wire import contracts
from streams.worker import wakeup
from streams.worker.runtime import RawMessage, Runtime

log = logging.getLogger(__name__)

CANCELLATIONS_TOPIC = "generation.cancellations"


def cancel_result(ask: CancelAsk) -> str:
    """What followed a cancellation (a label of ``streams_cancellations_total``): ``repeat`` when one was already
    recorded, ``canceled_before_post`` for ``accepted -> canceled`` now, ``at_provider`` when a job is (or is about
    to be) canceled at the provider, ``recorded`` otherwise (terminal, waiting for a decision, not yet accepted)."""
    if not ask.recorded:
        return "repeat"
    if ask.canceled_now:
        return "canceled_before_post"
    if ask.state_when_asked in POLLABLE or ask.state_when_asked is OperationState.SUBMITTING:
        return "at_provider"
    return "recorded"


def describe(ask: CancelAsk) -> str:
    """One log line's text for what a cancellation did (no reason text: it is the asker's words)."""
    state = ask.state_when_asked
    if not ask.recorded:
        return "cancellation already recorded; nothing written"
    if ask.canceled_now:
        return "canceled before the POST (accepted -> canceled); no POST will be sent"
    if state is None:
        return "cancellation recorded before the operation was accepted; its claim will end it canceled"
    if is_terminal(state):
        return f"cancellation recorded; the operation is already {state}, which stays"
    if state in POLLABLE or state is OperationState.SUBMITTING:
        return f"cancellation recorded ({state}); the job is canceled at the provider and observed until it ends"
    return f"cancellation recorded ({state}); applied once the operation observes a job again"


class Canceller:
    """Handles ``generation.cancellations`` events for one worker (see module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def handle(self, message: RawMessage) -> None:
        """Record one cancellation event; invalid input goes to the dead-letter topic."""
        rt = self.rt
        try:
            event = contracts.decode(CANCELLATIONS_TOPIC, message.value, rt.settings.max_value_bytes)
        except InvalidEventError as exc:
            await rt.dead_letter(message, exc)
            return
        operation_id: str = event["operation_id"]
        logs.bind(operation_id=operation_id)
        if message.key != operation_id.encode():
            error = InvalidEventError(
                "key_mismatch",
                f"record key {message.key!r} is not the operation id {operation_id!r}: every topic is keyed by "
                "operation id",
            )
            await rt.dead_letter(message, error)
            return
        ask = await rt.ledger.request_cancel(operation_id, CancelPath.TOPIC, event["requested_by"], event["reason"])
        metrics.CANCELLATIONS.labels(CancelPath.TOPIC.value, cancel_result(ask)).inc()
        if ask.poll_made_due:
            rt.wakeups.polls.notify(wakeup.CANCEL)
        log.info("%s (asked on %s)", describe(ask), message.topic)
