"""In-order acknowledgement of consumed events: no committed offset ever passes an event still in flight.

Faust commits, per partition, the run of consecutive acknowledged offsets that starts at the committed one
(``Consumer._new_offset``, faust-streaming 0.15.3). Its check for a hole at the head of that run,
``min(acked) - committed_offset > 1``, treats the committed offset as the last one handled, while Kafka's
committed offset is the *next* one to read: a run that starts one past the committed offset goes through
whatever is still in flight there. With the events of one partition handled concurrently and each
acknowledged when its own handling ends, offset 5 was committed while offset 2 was still in flight, and a
worker killed then never read offset 2 again.

:class:`InOrderAcks` releases an event for acknowledgement only once it and every event tracked before it in
its partition are handled, so the acknowledged offsets of a partition are always one run from the committed
offset: faust commits exactly the offsets whose handling finished. Events of one partition are still handled
concurrently; only their acknowledgements wait for each other.

Pure bookkeeping (no I/O); events are tracked in the order the stream delivers them, which within one
partition is offset order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

E = TypeVar("E")


@dataclass(eq=False)
class Ticket(Generic[E]):
    """One tracked event: its partition, the event, and whether its handling finished."""

    partition: Hashable
    event: E
    finished: bool = field(default=False)


class InOrderAcks(Generic[E]):
    """Per partition, releases events for acknowledgement in the order they were tracked.

    Usage: ``ticket = acks.track(tp, event)`` when the event is received, start handling it, and when the
    handling ends ``for e in acks.finish(ticket): e.ack()``. An event whose handling never ends (its worker
    stops or dies) keeps every later event of its partition unacknowledged, so the committed offset stays
    at it and the next owner of the partition reads it again.
    """

    def __init__(self) -> None:
        self._queues: dict[Hashable, deque[Ticket[E]]] = {}

    def track(self, partition: Hashable, event: E) -> Ticket[E]:
        """Register ``event`` (the next one of ``partition``) as being handled; returns its ticket."""
        ticket = Ticket(partition, event)
        self._queues.setdefault(partition, deque()).append(ticket)
        return ticket

    def finish(self, ticket: Ticket[E]) -> list[E]:
        """Mark ``ticket`` handled; returns the events now safe to acknowledge, in offset order (possibly none).

        Raises:
            ValueError: the ticket was already finished, or its partition has nothing tracked here.
        """
        if ticket.finished:
            raise ValueError(f"event of partition {ticket.partition!r} finished twice")
        queue = self._queues.get(ticket.partition)
        if queue is None:
            raise ValueError(f"event of partition {ticket.partition!r} is not tracked")
        ticket.finished = True
        released: list[E] = []
        while queue and queue[0].finished:
            released.append(queue.popleft().event)
        if not queue:
            del self._queues[ticket.partition]
        return released

    def blocked_partitions(self) -> int:
        """Partitions whose acknowledgements wait behind an event still being handled: the oldest tracked event is
        unfinished and a later one of the same partition has finished."""
        return sum(1 for q in self._queues.values() if not q[0].finished and any(t.finished for t in q))

    def in_flight(self) -> int:
        """Events tracked and not yet released (handled or not)."""
        return sum(len(q) for q in self._queues.values())
