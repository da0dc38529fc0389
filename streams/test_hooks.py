"""Fault-injection hooks for the process-level tests (seed acceptance checks). Each hook is off unless its
setting names a file; it fires once, when that file exists, by removing it and signalling this process."""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


def signal_self_once(path: str, sig: signal.Signals, where: str) -> bool:
    """If ``path`` is set and exists, remove it and send ``sig`` to this process; True when it fired."""
    if not path:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    log.warning("test hook: %s to this worker %s", sig.name, where)
    os.kill(os.getpid(), sig)
    return True
