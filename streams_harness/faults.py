"""Fault injection inside worker processes: actions at the product's hook points (:mod:`streams.hooks`).

Run a worker through this module instead of the ``streams`` script::

    HARNESS_PAUSE_AFTER_GET_FILE=/tmp/pause python -m streams_harness.faults worker --web-port 6070

It installs the actions the environment selects, then runs the ``streams`` command line with the remaining
arguments. Each action fires once: when its file exists at the hook point, it removes the file and signals
its own process.

=================================== ======================================================================
``HARNESS_PAUSE_AFTER_GET_FILE``    SIGSTOP after the observer's GET and lease renewal, before its fenced
                                    save (a test resumes it with SIGCONT)
``HARNESS_KILL_AFTER_PUBLISH_FILE`` SIGKILL after the relay published a batch holding an output, before it
                                    marked the batch published
``HARNESS_PAUSE_WHEN_READY_FILE``   SIGSTOP once the starting worker found the services ready, before Faust
                                    starts its clients (a test takes a service away, then resumes it)
``HARNESS_CRASH_AFTER_START_FILE``  a second after Faust reported the worker started, crash Faust's
                                    Conductor as a broker outage crashes it (``outage`` in the file:
                                    ``NodeNotReadyError``) or as a bug would (``bug``: ``RuntimeError``)
=================================== ======================================================================
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiokafka.errors

from streams import hooks
from streams.hooks import HookPoint

log = logging.getLogger(__name__)

PAUSE_AFTER_GET_FILE = "HARNESS_PAUSE_AFTER_GET_FILE"
KILL_AFTER_PUBLISH_FILE = "HARNESS_KILL_AFTER_PUBLISH_FILE"
PAUSE_WHEN_READY_FILE = "HARNESS_PAUSE_WHEN_READY_FILE"
CRASH_AFTER_START_FILE = "HARNESS_CRASH_AFTER_START_FILE"
#: Seconds after the start at which the crash hook fires.
CRASH_DELAY_S = 1.0


def signal_self_once(path: str, sig: signal.Signals, where: str) -> bool:
    """If ``path`` exists, remove it and send ``sig`` to this process; True when it fired."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    log.warning("fault hook: %s to this worker %s", sig.name, where)
    os.kill(os.getpid(), sig)
    return True


#: The actions that stop this process at a hook point: variable -> (point, where, for the log).
PAUSES = {
    PAUSE_AFTER_GET_FILE: (HookPoint.OBSERVED_BEFORE_SAVE, "between GET and save"),
    PAUSE_WHEN_READY_FILE: (HookPoint.SERVICES_READY_BEFORE_START, "with the services ready, before Faust starts"),
}


def _pause_action(path: str, where: str) -> hooks.Action:
    def pause(**context: Any) -> None:
        signal_self_once(path, signal.SIGSTOP, where)

    return pause


def _crash_reason(kind: str) -> BaseException:
    """The exception the crash hook crashes Faust with: an outage (``outage``) or a bug (anything else)."""
    if kind == "outage":
        outage: BaseException = aiokafka.errors.NodeNotReadyError("fault hook: node not ready")
        return outage
    return RuntimeError("fault hook: a bug in a Faust service")


def _crash_action(path: str) -> hooks.Action:
    crashes: set[asyncio.Task[None]] = set()  # referenced until done: the loop keeps only weak references

    def crash(*, worker: Any, **context: Any) -> None:
        try:
            kind = Path(path).read_text().strip()
            os.unlink(path)
        except FileNotFoundError:
            return
        reason = _crash_reason(kind)
        log.warning("fault hook: crashing Faust's Conductor in %.1f s with %r", CRASH_DELAY_S, reason)

        def fire() -> None:
            task = asyncio.ensure_future(worker.app.topics.crash(reason))
            crashes.add(task)
            task.add_done_callback(crashes.discard)

        asyncio.get_running_loop().call_later(CRASH_DELAY_S, fire)

    return crash


def install_from_env(environ: Mapping[str, str]) -> list[HookPoint]:
    """Install the actions ``environ`` selects (see the module docstring); returns the points armed."""
    armed: list[HookPoint] = []
    for variable, (point, where) in PAUSES.items():
        if path := environ.get(variable, ""):
            hooks.install(point, _pause_action(path, where))
            armed.append(point)
    kill_file = environ.get(KILL_AFTER_PUBLISH_FILE, "")
    if kill_file:

        def kill(*, rows: list[dict[str, Any]], **context: Any) -> None:
            if any(row["topic_role"] == "outputs_delivered" for row in rows):
                signal_self_once(kill_file, signal.SIGKILL, "after publishing, before marking")

        hooks.install(HookPoint.PUBLISHED_BEFORE_MARK, kill)
        armed.append(HookPoint.PUBLISHED_BEFORE_MARK)
    if crash_file := environ.get(CRASH_AFTER_START_FILE, ""):
        hooks.install(HookPoint.WORKER_STARTED, _crash_action(crash_file))
        armed.append(HookPoint.WORKER_STARTED)
    return armed


def main() -> None:
    """Arm the hooks from the environment, then run the ``streams`` command line."""
    from streams.cli import main as streams_main

    install_from_env(os.environ)
    streams_main(prog_name="streams")


if __name__ == "__main__":
    main()
