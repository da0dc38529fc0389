"""The completion-callback endpoint: a verified callback makes its job's poll due now (docs/callbacks.md).

A callback is a hint, polling the authority: the body is never saved as state, only its job id is read, and the
job's poll moves to now in the ledger (:meth:`~streams.ledger.store.Ledger.note_callback`, one statement under the
operation's row lock, idempotent by ``webhook-id``); then this worker's poll scheduler is woken
(:attr:`~streams.worker.runtime.Runtime.wakeups` ``.polls``, cause ``callback``). Any worker's scheduler claims
due polls, and the poll event is keyed by operation id, so a callback reaching a worker that does not own the
job's partition works the same: the owner's observer GETs the job under its lease.

Answers (each refusal counted in ``streams_callbacks_refused_total{reason}``, one log line without body or
signature):

* 204: recorded (``streams_callbacks_received_total{result}``: ``poll_now``, ``poll_claimed`` or ``no_change``);
* 200 for a replay (the ``webhook-id`` was recorded before): acknowledged, as the Standard Webhooks
  specification asks of a receiver that already processed a delivery, so the sender stops retrying; nothing done;
* 400 malformed headers or body, 401 bad signature or stale timestamp, 408 body slower than
  ``callback_body_timeout_s``, 413 body over ``callback_max_body_bytes``, 404 unknown job (no operation has that
  job id, e.g. the POST's answer is not saved yet: the sender's retry finds it), 503 ledger unavailable (the
  sender retries).
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from streams import metrics
from streams.errors import CallbackRefusedError, LedgerUnavailableError
from streams.model.codes import CallbackRefusal
from streams.remote import callbacks
from streams.worker import wakeup
from streams.worker.runtime import Runtime

log = logging.getLogger(__name__)

#: Longest wait for the ledger's record of one callback (s), outages included; then 503 (the sender retries, and
#: its own timeout is typically 15 to 30 s).
NOTE_DEADLINE_S = 10.0
#: Bytes read from the request body at a time while its size is checked.
READ_CHUNK_BYTES = 16 * 1024
#: The log line's words per ``streams_callbacks_received_total`` result.
_SAID = {
    "poll_now": "polled now (a poll being observed meanwhile is followed by another at once)",
    "poll_claimed": "poll claimed already: its GET comes after this callback",
    "no_change": "already due or ended: nothing changed",
}


class CallbackReceiver:
    """Handles ``POST <callback_path>`` for one worker (see the module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._keys = runtime.settings.callback_secret_keys

    async def handle(self, request: web.Request) -> web.Response:
        """Verify, record and turn one callback into a due poll; never raises (the answer says what happened)."""
        try:
            body = await self._body(request)
            s = self.rt.settings
            webhook_id = callbacks.verify(
                request.headers, body, self._keys, tolerance_s=s.callback_timestamp_tolerance_s, now_s=time.time()
            )
            job_id = callbacks.job_id_of(body)
        except CallbackRefusedError as exc:
            return self._refused(exc)
        try:
            async with asyncio.timeout(NOTE_DEADLINE_S):  # the ledger waits out outages: bounded here
                note = await self.rt.ledger.note_callback(webhook_id, job_id)
        except (LedgerUnavailableError, TimeoutError) as exc:
            self.rt.log_outage("PostgreSQL", exc)
            return web.Response(status=503, text="ledger unavailable; retry later\n")
        if note.operation_id is None:
            return self._refused(
                CallbackRefusedError(
                    CallbackRefusal.UNKNOWN_JOB,
                    404,
                    f"delivery {webhook_id!r}: no operation has job {job_id!r} (yet); the sender retries",
                )
            )
        if not note.recorded:
            metrics.CALLBACKS_REFUSED.labels(CallbackRefusal.REPLAY.value).inc()
            log.info("callback %s for job %s is a replay: acknowledged, nothing done", webhook_id, job_id)
            return web.Response(status=200, text="already received\n")
        result = "poll_now" if note.made_due else "poll_claimed" if note.hinted else "no_change"
        metrics.CALLBACKS_RECEIVED.labels(result).inc()
        if note.made_due:
            self.rt.wakeups.polls.notify(wakeup.CALLBACK)
        log.info("callback %s: operation %s (job %s) %s", webhook_id, note.operation_id, job_id, _SAID[result])
        return web.Response(status=204)

    async def _body(self, request: web.Request) -> bytes:
        """The raw body, at most ``callback_max_body_bytes`` (a longer one is refused without being held), within
        ``callback_body_timeout_s`` (a slower one is refused: ``body_timeout``, 408)."""
        limit = self.rt.settings.callback_max_body_bytes
        too_large = CallbackRefusedError(
            CallbackRefusal.BODY_TOO_LARGE, 413, f"the body is over callback_max_body_bytes ({limit})"
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        deadline_s = self.rt.settings.callback_body_timeout_s
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(deadline_s):
                async for chunk in request.content.iter_chunked(READ_CHUNK_BYTES):
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            raise CallbackRefusedError(
                CallbackRefusal.BODY_TIMEOUT,
                408,
                f"the body did not arrive within callback_body_timeout_s ({deadline_s:g} s); {size} bytes came",
            ) from None
        return b"".join(chunks)

    @staticmethod
    def _refused(exc: CallbackRefusedError) -> web.Response:
        metrics.CALLBACKS_REFUSED.labels(exc.reason.value).inc()
        log.warning("%s", exc)
        return web.Response(status=exc.status, text=f"refused: {exc.reason.value}\n")
