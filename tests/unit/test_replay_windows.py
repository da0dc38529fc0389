"""``streams purge --ids-older-than`` deletes a purged id only once no topic that can replay its submission keeps
records that old: how a topic's configs read as a replay window, and when a horizon is refused."""

from __future__ import annotations

import pytest

from streams.setup.admin import ReplayWindow, replay_refusals, replay_window

DAY_MS = 86_400_000


@pytest.mark.parametrize(
    ("configs", "retention_ms"),
    [
        ({"retention.ms": "604800000", "cleanup.policy": "delete"}, 7 * DAY_MS),
        ({"retention.ms": "604800000", "cleanup.policy": "compact,delete"}, 7 * DAY_MS),
        ({"retention.ms": "604800000", "cleanup.policy": "[delete, compact]"}, 7 * DAY_MS),
        ({"retention.ms": "0", "cleanup.policy": "delete"}, 0),
        ({"retention.ms": "-1", "cleanup.policy": "delete"}, None),  # no time limit
        ({"retention.ms": "604800000", "cleanup.policy": "compact"}, None),  # a key's latest record kept for good
        ({"cleanup.policy": "delete"}, None),  # not reported: assume the worst
        ({"retention.ms": "soon", "cleanup.policy": "delete"}, None),
        ({"retention.ms": "604800000"}, 7 * DAY_MS),  # the broker's default policy is delete
    ],
)
def test_a_topics_configs_read_as_its_replay_window(configs: dict[str, str], retention_ms: int | None) -> None:
    assert replay_window("t", configs) == ReplayWindow("t", retention_ms)


def test_a_missing_topic_is_no_window_to_trust() -> None:
    assert replay_window("t", None) == ReplayWindow("t", None, exists=False)


def test_a_horizon_is_refused_unless_every_window_is_shorter() -> None:
    windows = [ReplayWindow("subs", 7 * DAY_MS), ReplayWindow("dead", 14 * DAY_MS)]
    assert replay_refusals(windows, 14 * 86_400 + 1) == []
    assert replay_refusals(windows, 14 * 86_400) == ["dead keeps its records 1.2096e+06 s (retention.ms)"]
    assert replay_refusals(windows, 7 * 86_400) == [
        "subs keeps its records 604800 s (retention.ms)",
        "dead keeps its records 1.2096e+06 s (retention.ms)",
    ]
    assert replay_refusals([ReplayWindow("subs", None)], 10**9) == ["subs keeps its records without a time limit"]
    assert replay_refusals([ReplayWindow("subs", None, exists=False)], 10**9) == [
        "topic subs does not exist (check STREAMS_TOPIC_PREFIX)"
    ]
    assert replay_refusals(windows, 7 * 86_400, lambda s: f"{s / 86_400:g}d") == [
        "subs keeps its records 7d (retention.ms)",
        "dead keeps its records 14d (retention.ms)",
    ]
