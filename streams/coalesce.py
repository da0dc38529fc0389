"""Automatic batching of round trips ("group commit" for Redis commands and ledger statements).

Each event is handled in its own task (:mod:`streams.worker.app`), so at any moment many tasks of one worker are
at the same stage: acquiring a lease, claiming an operation, saving an observation. A :class:`Coalescer`
gathers the requests those tasks make of one kind and sends them as one batch: every request made before the
loop gets back to it joins the batch, and while ``max_in_flight`` batches are on the wire new requests wait
and go out together in the next one. Under load (the stage's latest batch held several requests and the stage
has not idled for ``linger_s`` since) a batch also waits ``linger_s`` (:data:`LINGER_UNDER_LOAD_S`, 5 ms) for
more before it goes, as a Kafka producer's ``linger.ms``: a round trip then carries many operations. At low load
a batch holds one request, does not wait, and costs one pass of the event loop; so does the first batch after a
burst once the stage has idled.

Each caller still gets its own result or its own exception (the flush function returns one per request), so
the per-operation logic, its fault handling and its tests stay as they are. A failure of the whole batch (the
service did not answer) is raised to every caller of that batch.

Cancellation: a caller cancelled while its request waits in the queue takes it out (nothing is sent); one
cancelled while its batch is on the wire only stops waiting: the batch runs to its end. A request that must
complete whatever happens to its caller is submitted from a shielded task
(:meth:`streams.coordination.lease.Lease.release`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from streams import metrics

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Res = TypeVar("Res")

#: How long a batch waits for more requests when the stage's latest batch held several (load): 5 ms, as Kafka's
#: producer ``linger.ms`` default since Kafka 4.0 (KIP-1030): fewer round trips per operation under load (by
#: ``streams bench``: CHANGELOG.md); a request at low load (batches of one) never waits.
LINGER_UNDER_LOAD_S = 0.005

#: One flush: the requests of a batch, in order -> one result (or exception) per request, in the same order.
Flush = Callable[[list[Req]], Awaitable[Sequence[Res | BaseException]]]


@dataclass(eq=False)
class _Pending(Generic[Req, Res]):
    request: Req
    future: asyncio.Future[Res] = field(repr=False)


class Coalescer(Generic[Req, Res]):
    """Sends the requests of many tasks as batches through one ``flush`` function.

    Args:
        name: the stage, as a label of ``streams_batch_size`` (e.g. ``"redis"``, ``"claim_observe"``).
        flush: ``async (requests) -> results``: one result or exception per request, same order and length
            (a length mismatch is a programming error, raised to every caller). Raising fails the whole batch.
        max_batch: most requests in one batch.
        max_in_flight: most batches on the wire at once; further requests queue for the next batch.
        linger_s: when the latest batch held more than one request and is on the wire or came back less than
            ``linger_s`` ago, the next one waits this long (seconds) for more before it is sent, unless the queue
            already fills a batch when it is scheduled; 0: never waits (:data:`LINGER_UNDER_LOAD_S` for the
            worker's stages).

    Errors: whatever ``flush`` raises or returns for a request is raised to that request's caller.
    """

    def __init__(
        self,
        name: str,
        flush: Flush[Req, Res],
        *,
        max_batch: int = 256,
        max_in_flight: int = 2,
        linger_s: float = 0.0,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1:
            raise ValueError("max_batch and max_in_flight must be at least 1")
        if linger_s < 0:
            raise ValueError("linger_s must not be negative")
        self.name = name
        self._flush = flush
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self.linger_s = linger_s
        #: Requests in the latest batch sent: more than one means other tasks are at this step too (load).
        self._last_batch_size = 0
        #: When (``loop.time()``, seconds) the latest batch came back: a stage idle for longer than ``linger_s``
        #: since is no longer under load, whatever its latest batch held.
        self._last_batch_ended_at = float("-inf")
        self._queue: list[_Pending[Req, Res]] = []
        self._in_flight = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        #: The batch task scheduled and not yet started (at most one: ``_scheduled``).
        self._not_started: asyncio.Task[None] | None = None
        self._batch_size = metrics.BATCH_SIZE.labels(name)

    @property
    def in_flight(self) -> int:
        """Batches on the wire now (their flush started and has not returned)."""
        return self._in_flight

    @property
    def queued(self) -> int:
        """Requests waiting for the next batch."""
        return len(self._queue)

    async def submit(self, request: Req) -> Res:
        """Send ``request`` in the next batch and return its result.

        Raises:
            whatever the flush raised for the batch or returned for this request.
        """
        loop = asyncio.get_running_loop()
        pending: _Pending[Req, Res] = _Pending(request, loop.create_future())
        self._queue.append(pending)
        self._schedule(loop)
        try:
            return await pending.future
        except asyncio.CancelledError:
            if pending in self._queue:  # not sent yet: take it out
                self._queue.remove(pending)
            raise

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._scheduled and self._in_flight < self.max_in_flight:
            self._scheduled = True
            # The batch's task takes the queue on its first step, in the loop's next pass: the tasks already ready
            # in this pass join the batch first, and the flush starts in that same step (no further pass).
            task = loop.create_task(self._start())
            self._not_started = task
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task is self._not_started:  # cancelled before its first step, so it never cleared the flag: without
            self._not_started = None  # this no batch would ever be scheduled again, and every request would wait
            self._scheduled = False
            if self._queue:
                self._schedule(asyncio.get_running_loop())

    def _under_load(self) -> bool:
        """The latest batch held several requests and the stage has not been idle since for ``linger_s``."""
        if self._last_batch_size <= 1:
            return False
        idle_s = asyncio.get_running_loop().time() - self._last_batch_ended_at
        return self._in_flight > 0 or idle_s < self.linger_s

    async def _start(self) -> None:
        if self.linger_s and len(self._queue) < self.max_batch and self._under_load():
            # Under load (the latest batch held several requests, just now) a batch waits a little for more:
            # fewer, larger round trips. At low load (batches of one, or a first request after an idle spell, as
            # after a burst) it goes at once, so latency stays one loop pass.
            await asyncio.sleep(self.linger_s)
        self._scheduled = False
        self._not_started = None
        if not self._queue or self._in_flight >= self.max_in_flight:  # every caller went away meanwhile
            return
        batch = self._queue[: self.max_batch]
        del self._queue[: self.max_batch]
        self._in_flight += 1
        if self._queue:  # more than one batch's worth: the next one goes out too, as far as max_in_flight allows
            self._schedule(asyncio.get_running_loop())
        await self._run(batch)

    async def _run(self, batch: list[_Pending[Req, Res]]) -> None:
        self._batch_size.observe(len(batch))
        self._last_batch_size = len(batch)
        try:
            try:
                results = await self._flush([p.request for p in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"{self.name}: flush returned {len(results)} results for {len(batch)} requests")
            except BaseException as exc:  # handed to every caller of the batch
                for p in batch:
                    if not p.future.done():
                        if isinstance(exc, asyncio.CancelledError):
                            p.future.cancel()
                        else:
                            p.future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            for p, result in zip(batch, results, strict=True):
                if p.future.done():  # the caller went away
                    continue
                if isinstance(result, BaseException):
                    p.future.set_exception(result)
                else:
                    p.future.set_result(result)
        finally:
            self._in_flight -= 1
            self._last_batch_ended_at = asyncio.get_running_loop().time()
            if self._queue:
                self._schedule(asyncio.get_running_loop())

    async def drain(self) -> None:
        """Wait for every batch on the wire (and those queued behind them) to finish; for shutdown."""
        while self._tasks or self._queue:
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            else:
                await asyncio.sleep(0)
