"""``streams purge --ids-older-than`` deletes a purged id only once no topic that can replay its submission may
still keep a record that old: how a topic's configs read as a replay window, and when a horizon is refused."""

from __future__ import annotations

import pytest
from aiokafka.structs import TopicPartition

from streams.setup.admin import REPLAY_MARGIN_S, ReplayWindow, behind_phrases, replay_refusals, replay_window

DAY_MS = 86_400_000
WEEK = {"retention.ms": str(7 * DAY_MS), "segment.ms": str(7 * DAY_MS)}


@pytest.mark.parametrize(
    ("configs", "longest_ms"),
    [
        ({**WEEK, "cleanup.policy": "delete"}, 14 * DAY_MS),  # a record lives up to a segment's span past retention
        ({**WEEK, "segment.ms": "3600000", "cleanup.policy": "delete"}, 7 * DAY_MS + 3_600_000),
        ({**WEEK, "cleanup.policy": "compact,delete"}, 14 * DAY_MS),
        ({**WEEK, "cleanup.policy": "[delete, compact]"}, 14 * DAY_MS),
        ({"retention.ms": "0", "segment.ms": "0", "cleanup.policy": "delete"}, 0),
        ({**WEEK, "retention.ms": "-1", "cleanup.policy": "delete"}, None),  # no time limit
        ({**WEEK, "cleanup.policy": "compact"}, None),  # a key's latest record kept for good
        ({**WEEK}, None),  # a policy the broker did not report: assume the worst
        ({"segment.ms": str(DAY_MS), "cleanup.policy": "delete"}, None),
        ({"retention.ms": str(DAY_MS), "cleanup.policy": "delete"}, None),
        ({**WEEK, "retention.ms": "soon", "cleanup.policy": "delete"}, None),
    ],
)
def test_a_topics_configs_read_as_its_replay_window(configs: dict[str, str], longest_ms: int | None) -> None:
    assert replay_window("t", configs) == ReplayWindow("t", longest_ms)


def test_a_missing_topic_is_no_window_to_trust() -> None:
    assert replay_window("t", None) == ReplayWindow("t", None, exists=False)


def test_a_horizon_is_refused_unless_it_exceeds_every_window_by_the_margin() -> None:
    assert REPLAY_MARGIN_S == 86_400
    windows = [ReplayWindow("subs", 14 * DAY_MS), ReplayWindow("dead", 21 * DAY_MS)]
    day = 86_400
    assert replay_refusals(windows, 22 * day + 1) == []
    assert replay_refusals(windows, 22 * day, lambda s: f"{s / day:g}d") == [
        "dead may keep a record 21d (retention.ms + segment.ms; a horizon must exceed it by 1d)"
    ]
    assert len(replay_refusals(windows, 15 * day)) == 2
    assert replay_refusals(windows, 15 * day + 1) == [
        "dead may keep a record 1.8144e+06 s (retention.ms + segment.ms; a horizon must exceed it by 86400 s)"
    ]
    assert replay_refusals([ReplayWindow("subs", None)], 10**9) == ["subs keeps its records without a time limit"]
    assert replay_refusals([ReplayWindow("subs", None, exists=False)], 10**9) == [
        "topic subs does not exist (check STREAMS_TOPIC_PREFIX)"
    ]


def test_a_partition_is_behind_until_its_committed_offset_reaches_the_end_taken_before() -> None:
    """``streams purge --ids-older-than`` waits for the workers to consume what was written before it: a partition
    never committed counts from its first record still kept (records that expired need no reading)."""
    a, b, c, d = (TopicPartition("subs", p) for p in range(4))
    starts = {a: 0, b: 0, c: 40, d: 0}
    ends = {a: 10, b: 10, c: 40, d: 0}
    committed = {a: 10, b: 7, c: -1}  # d: no answer for it (never committed, and nothing written)
    assert behind_phrases([a, b, c, d], starts, ends, committed) == ["subs[1]: consumed up to 7 of 10"]
    assert behind_phrases([a, b], starts, ends, {a: -1, b: 10}) == ["subs[0]: consumed up to 0 of 10"]
