"""The stop's deadline (:class:`streams.worker.process.StopDeadline`): it ends the process once overdue, from a
thread of its own, and never when cancelled in time."""

from __future__ import annotations

import threading

import pytest

from streams.errors import EXIT_UNAVAILABLE
from streams.worker.process import StopDeadline


def test_an_overdue_stop_exits_with_status_5_and_an_error_line(caplog: pytest.LogCaptureFixture) -> None:
    exited: list[int] = []
    done = threading.Event()

    def exit_(status: int) -> None:
        exited.append(status)
        done.set()

    StopDeadline(0.05, exit=exit_).start()
    assert done.wait(5.0)
    assert exited == [EXIT_UNAVAILABLE]
    assert "streams worker did not stop within 0.05 s" in caplog.text


def test_a_stop_cancelled_in_time_never_exits() -> None:
    exited: list[int] = []
    deadline = StopDeadline(0.2, exit=exited.append)
    deadline.start()
    deadline.cancel()
    deadline._timer.join(5.0)
    assert exited == []
