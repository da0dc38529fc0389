"""The main job's report counts completion callbacks when the simulator sent them (docs/callbacks.md)."""

from __future__ import annotations

from streams_harness.report import callback_counts


def test_callbacks_sent_received_and_refused_by_status() -> None:
    sent = {
        "scheduled": 10,
        "lost": 1,
        "duplicated": 2,
        "reordered": 3,
        "bad_signature": 1,
        "attempts": 14,
        "acknowledged": 10,
        "refused": 4,
        "unanswered": 0,
        "statuses": {"204": 8, "200": 2, "401": 3, "404": 1},
    }
    assert callback_counts(sent, received=8, made_due=7) == {
        "scheduled": 10,
        "lost": 1,
        "duplicated": 2,
        "reordered": 3,
        "bad_signature": 1,
        "attempts": 14,
        "unanswered": 0,
        "received": 8,
        "made_due": 7,
        "replays": 2,
        "refused_401": 3,
        "refused_404": 1,
    }


def test_no_callbacks_section_when_none_were_sent() -> None:
    assert callback_counts(None, 0, 0) is None
    assert callback_counts({"scheduled": 0, "statuses": {}}, 0, 0) is None
