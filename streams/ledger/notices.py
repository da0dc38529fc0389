"""The ledger's notifications: one dedicated connection that LISTENs for committed outbox rows.

Every statement inserting outbox rows notifies :data:`OUTBOX_CHANNEL` in its own transaction (the trigger of
migrations ``0014.wakeups`` and ``0016.wakeup-kinds``), so a notification arrives only once its rows are committed,
from any worker; its payload names what was inserted (:data:`OUTPUTS_PAYLOAD`, :data:`TRANSITIONS_PAYLOAD`; empty
from the trigger of ``0014``: outputs). :class:`OutboxListener` passes each one on (``on_notice("notified")`` for
outputs, ``on_notice("transitions")`` for transitions alone), after each (re)connection one
``on_notice("listening")`` (rows committed while it was not listening are looked for then), and when a connection
is lost one ``on_notice("unlistened")`` (the relay then sleeps its short fallback again). A notification can still
be lost (the connection dropped between a commit and its delivery): the reconnection's ``listening`` covers that,
and the relay's fallback timer anything else, so a lost notification only delays a row.

The connection is re-opened after it is lost, fails to open or fails to LISTEN, forever, each attempt logged and counted
(``streams_ledger_listener_connects_total{result}``), waiting :data:`RETRY_FIRST_WAIT_S` doubling up to the
caller's cap between attempts; a connection is checked with ``SELECT 1`` every :data:`CHECK_INTERVAL_S` (a
peer gone without closing the socket).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import asyncpg

from streams import metrics
from streams.errors import error_summary
from streams.ledger import connect_options
from streams.ledger.connect_options import application_name
from streams.ledger.pool import database_address

log = logging.getLogger(__name__)

#: The channel of outbox notifications (named in migrations/0014.wakeups.sql too).
OUTBOX_CHANNEL = "streams_outbox"

#: Seconds between two checks that the listening connection still answers.
CHECK_INTERVAL_S = 30.0
#: Seconds a connection attempt or a check may take.
CONNECT_TIMEOUT_S = 10.0
#: First wait (s) after the connection was lost or failed to open; each next failure doubles it, up to the cap.
RETRY_FIRST_WAIT_S = 0.2

#: Causes passed to ``on_notice``: outputs committed, transitions alone committed, (re)connected, connection lost.
NOTIFIED = "notified"
TRANSITIONS = "transitions"
LISTENING = "listening"
UNLISTENED = "unlistened"

#: Payloads of the trigger of migration 0016.wakeup-kinds.
OUTPUTS_PAYLOAD = "outputs"
TRANSITIONS_PAYLOAD = "transitions"


def notice_cause(payload: str) -> str:
    """The ``on_notice`` cause of a notification's ``payload``: :data:`TRANSITIONS` for transitions alone, else
    :data:`NOTIFIED` (outputs, the empty payload of migration 0014's trigger, or one this version does not know)."""
    return TRANSITIONS if payload == TRANSITIONS_PAYLOAD else NOTIFIED


class OutboxListener:
    """LISTEN for outbox notifications on one connection to ``database_url``; call ``on_notice(cause)`` for each
    (:func:`notice_cause`), after each (re)connection (:data:`LISTENING`) and when a connection is lost
    (:data:`UNLISTENED`). :meth:`run` until cancelled."""

    def __init__(self, database_url: str, on_notice: Callable[[str], None], *, retry_cap_s: float) -> None:
        self._database_url = database_url
        self._on_notice = on_notice
        self._retry_cap_s = retry_cap_s
        #: The server process id of the listening connection, None while not connected.
        self.backend_pid: int | None = None
        #: Connections opened so far (1 after the first; each reconnection adds one).
        self.connections = 0

    async def run(self) -> None:
        """Listen, reconnecting forever; returns only by cancellation (the connection is closed then)."""
        failures = 0
        address = database_address(self._database_url)
        name = application_name(self._database_url, worker=True)
        while True:
            try:
                conn = await connect_options.connect(
                    self._database_url,
                    timeout=CONNECT_TIMEOUT_S,
                    server_settings={"application_name": name},
                )
            except Exception as exc:  # an outage or a wrong setting: the pool reports those too; keep trying
                failures += 1
                wait_s = min(self._retry_cap_s, RETRY_FIRST_WAIT_S * 2 ** (failures - 1))
                metrics.LEDGER_LISTENER_CONNECTS.labels("failed").inc()
                log.warning(
                    "outbox listener: connecting to PostgreSQL at %s failed (%s); retrying in %.1f s (outbox "
                    "rows of other workers wait for the relay's fallback meanwhile)",
                    address,
                    error_summary(exc),
                    wait_s,
                )
                await asyncio.sleep(wait_s)
                continue
            listened = False
            try:
                await self._listen(conn, address, reconnected=self.connections > 0)
            except Exception as exc:  # LISTEN failed: the connection was lost as it opened (or a bug): reconnect
                log.warning(
                    "outbox listener: LISTEN on %s at %s failed (%s)",
                    OUTBOX_CHANNEL,
                    address,
                    error_summary(exc),
                )
            finally:
                listened, self.backend_pid = self.backend_pid is not None, None
                conn.terminate()
                if listened:
                    self._on_notice(UNLISTENED)
            metrics.LEDGER_LISTENER_CONNECTS.labels("lost").inc()
            if listened:  # it listened: reconnect at once
                failures = 0
                log.warning("outbox listener: connection to PostgreSQL at %s lost; reconnecting", address)
                continue
            failures += 1  # lost before it listened: wait as after a failed attempt, never a busy loop
            wait_s = min(self._retry_cap_s, RETRY_FIRST_WAIT_S * 2 ** (failures - 1))
            log.warning(
                "outbox listener: connection to PostgreSQL at %s lost before it listened; reconnecting in %.1f s",
                address,
                wait_s,
            )
            await asyncio.sleep(wait_s)

    async def _listen(self, conn: asyncpg.Connection, address: str, *, reconnected: bool) -> None:
        """Listen on ``conn`` until it is lost (returns) or the task is cancelled."""
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        async with asyncio.timeout(CONNECT_TIMEOUT_S):  # LISTEN on a backend that stopped answering: reconnect
            await conn.add_listener(OUTBOX_CHANNEL, self._notified)
        self.connections += 1
        self.backend_pid = conn.get_server_pid()
        metrics.LEDGER_LISTENER_CONNECTS.labels("connected").inc()
        log.log(
            logging.WARNING if reconnected else logging.INFO,
            "outbox listener: %s on %s at %s (server pid %s)",
            "reconnected, listening" if reconnected else "listening",
            OUTBOX_CHANNEL,
            address,
            self.backend_pid,
        )
        self._on_notice(LISTENING)
        while not lost.is_set():
            try:
                async with asyncio.timeout(CHECK_INTERVAL_S):
                    await lost.wait()
            except TimeoutError:
                try:
                    await conn.execute("SELECT 1", timeout=CONNECT_TIMEOUT_S)
                except Exception as exc:  # gone without closing the socket, or closed meanwhile
                    log.info("outbox listener: check failed: %s", error_summary(exc))
                    return

    @property
    def listening(self) -> bool:
        """True while the connection is open and LISTENing."""
        return self.backend_pid is not None

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: object) -> None:
        cause = notice_cause(payload if isinstance(payload, str) else "")
        metrics.LEDGER_NOTIFICATIONS.labels(OUTPUTS_PAYLOAD if cause == NOTIFIED else TRANSITIONS_PAYLOAD).inc()
        self._on_notice(cause)
