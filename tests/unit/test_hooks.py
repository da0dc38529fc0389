"""Hook points (streams.hooks) are no-ops unless the harness installs an action; the harness's fault actions
(streams_harness.faults) fire once, on the right batches."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streams import hooks
from streams.config import Settings
from streams.hooks import HookPoint
from streams_harness import faults


@pytest.fixture(autouse=True)
def no_actions() -> Iterator[None]:
    hooks.clear()
    yield
    hooks.clear()


def test_reaching_a_point_without_an_action_does_nothing() -> None:
    for point in HookPoint:
        hooks.reach(point, rows=[{"topic_role": "outputs_delivered"}], operation_id="op-1")


def test_an_installed_action_gets_the_context() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    hooks.install(HookPoint.OBSERVED_BEFORE_SAVE, lambda **ctx: seen.append(("observed", ctx)))
    hooks.reach(HookPoint.PUBLISHED_BEFORE_MARK, rows=[])
    hooks.reach(HookPoint.OBSERVED_BEFORE_SAVE, operation_id="op-7")
    assert seen == [("observed", {"operation_id": "op-7"})]


def test_settings_carry_no_test_switch() -> None:
    assert [name for name in Settings.model_fields if "test" in name or "hook" in name] == []


def test_nothing_is_armed_without_the_variables() -> None:
    assert faults.install_from_env({"HARNESS_PAUSE_AFTER_GET_FILE": ""}) == []
    hooks.reach(HookPoint.OBSERVED_BEFORE_SAVE, operation_id="op-1")


def test_signal_self_once_fires_once_and_removes_the_file(tmp_path: Path) -> None:
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        hook = tmp_path / "fire"
        hook.touch()
        assert faults.signal_self_once(str(hook), signal.SIGUSR1, "in a test") is True
        assert not hook.exists() and received == [signal.SIGUSR1]
        assert faults.signal_self_once(str(hook), signal.SIGUSR1, "in a test") is False
        assert received == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_armed_actions_signal_at_their_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fired: list[tuple[str, signal.Signals]] = []

    def signal_self_once(path: str, sig: signal.Signals, where: str) -> bool:
        fired.append((path, sig))
        return True

    monkeypatch.setattr(faults, "signal_self_once", signal_self_once)
    pause, kill, ready = str(tmp_path / "pause"), str(tmp_path / "kill"), str(tmp_path / "ready")
    armed = faults.install_from_env(
        {
            faults.PAUSE_AFTER_GET_FILE: pause,
            faults.KILL_AFTER_PUBLISH_FILE: kill,
            faults.PAUSE_WHEN_READY_FILE: ready,
            "OTHER": "x",
        }
    )
    assert armed == [
        HookPoint.OBSERVED_BEFORE_SAVE,
        HookPoint.SERVICES_READY_BEFORE_START,
        HookPoint.PUBLISHED_BEFORE_MARK,
    ]
    hooks.reach(HookPoint.PUBLISHED_BEFORE_MARK, rows=[{"topic_role": "transitions"}])
    assert fired == []  # a batch without an output is not the moment
    hooks.reach(
        HookPoint.PUBLISHED_BEFORE_MARK, rows=[{"topic_role": "transitions"}, {"topic_role": "outputs_delivered"}]
    )
    hooks.reach(HookPoint.OBSERVED_BEFORE_SAVE, operation_id="op-1")
    hooks.reach(HookPoint.SERVICES_READY_BEFORE_START)
    assert fired == [(kill, signal.SIGKILL), (pause, signal.SIGSTOP), (ready, signal.SIGSTOP)]
