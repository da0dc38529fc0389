"""The operators' pure helpers: durations, ages, actor, text tables, and the live view's escaping."""

from __future__ import annotations

import datetime as dt
import html.parser

import pytest

from streams.oncall import liveview as web
from streams.oncall import operations as operators
from streams.oncall.operations import OperationList, actor, format_age, given_actor, os_user, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("5m", 300),
        ("2h", 7200),
        ("1d", 86400),
        ("1.5h", 5400),
        ("1h30m", 5400),
        (" 2D ", 172800),
        ("1d2h3m4s", 93784),
        ("0.5s", 0.5),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        *("", "30", "s", "5 m", "5min", "1m1h", "1h1h", "-5m", "5m!", "0s", "1e3s", "36501d", "99999999999999999999d"),
        *("6M", "1d6M"),  # months or minutes?
        *("\u0661\u0662s", "\uff11s", "1\u0660m"),  # digits of other scripts
    ],
)
def test_not_durations(text: str) -> None:
    """Past 100 years the window's start falls before PostgreSQL's earliest timestamp: a traceback, not an answer."""
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_the_longest_duration_is_taken() -> None:
    assert parse_duration("36500d") == 36500 * 86400


def test_a_limit_too_large_is_a_usage_error() -> None:
    """A ``--limit`` beyond a bigint reached PostgreSQL and ended in a traceback."""
    from click.testing import CliRunner

    from streams.cli import main

    for args in (["operations", "list"], ["dead-letters", "list"]):
        result = CliRunner().invoke(main, [*args, "--limit", "99999999999999999999"])
        assert result.exit_code == 2 and "is not in the range 1<=x<=1000000" in result.output


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (-0.2, "0.0s"),
        (0.04, "0.0s"),
        (42.06, "42.1s"),
        (59.94, "59.9s"),
        (60, "1m00s"),
        (195.9, "3m15s"),
        (3600, "1h00m"),
        (7380, "2h03m"),
        (86400, "1d00h"),
        (100800, "1d04h"),
    ],
)
def test_ages(seconds: float | None, text: str) -> None:
    assert format_age(seconds) == text


def test_epoch_ms() -> None:
    assert operators.format_epoch_ms(None) == "-"
    assert operators.format_epoch_ms(1_700_000_000_123) == "2023-11-14T22:13:20.123Z"
    assert operators.format_epoch_ms(10**20) == "100000000000000000000 ms since the epoch"


def test_actor_is_the_database_role_and_the_os_user_with_a_given_actor_beside_them() -> None:
    assert actor("streams", "alice") == "streams@postgres-role/alice@os"
    assert actor("streams", "alice", "bob") == "streams@postgres-role/alice@os (given: bob)"
    assert actor("op_1", "alice", " \n ") == "op_1@postgres-role/alice@os"
    assert actor("r", "u", "a\x1b[31mb\n" + "x" * 300) == "r@postgres-role/u@os (given: a [31mb " + "x" * 192 + ")"


def test_os_user_and_given_actor_order() -> None:
    assert os_user({"USER": " alice ", "LOGNAME": "root"}) == "alice"
    assert os_user({"USER": " ", "LOGNAME": "carol"}) == "carol"
    assert given_actor(None, {"STREAMS_ACTOR": " alice "}) == "alice"
    assert given_actor("bob", {"STREAMS_ACTOR": "alice"}) == "bob"
    assert given_actor(" ", {"STREAMS_ACTOR": ""}) is None


def test_table_and_list_text() -> None:
    assert operators.table(["A", "LONGER"], [["x", None], ["yyyy", 3]]) == "A     LONGER\nx     -\nyyyy  3"
    rows = [
        {
            "operation_id": "op-1",
            "state": "uncertain",
            "state_age_s": 125.0,
            "reason": "r " * 80,
            "remote_job_id": None,
            "fencing_token": 1,
            "reason_code": "unknown_outcome",
        }
    ]
    text = operators.format_list(OperationList(rows, matched=3))
    header, line, more = text.splitlines()
    assert header.split() == ["OPERATION", "STATE", "AGE", "JOB", "ID", "FENCING", "CODE", "REASON"]
    assert line.split()[:6] == ["op-1", "uncertain", "2m05s", "-", "1", "unknown_outcome"] and line.endswith("...")
    assert more == "... 2 more (raise --limit)"
    assert operators.format_list(OperationList([], 0)) == "no operations match"


class _Text(html.parser.HTMLParser):
    """Visible text and tag names of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


HOSTILE = '<script>alert("x")</script> & <b>bold</b>'


def _overview() -> dict[str, object]:
    now = dt.datetime(2026, 5, 2, 10, 0, 30, tzinfo=dt.UTC)
    return {
        "now": now,
        "states": {"uncertain": 1, "succeeded": 4},
        "throughput": operators._throughput(now, 3, []),
        "queues": {
            "uncertain": {
                "matched": 1,
                "oldest_age_s": 61.0,
                "rows": [{"operation_id": 'op<1>"', "remote_job_id": None, "reason": HOSTILE, "state_age_s": 61.0}],
            },
            "stalled": {"matched": 0, "oldest_age_s": None, "rows": []},
        },
        "outbox": {"unpublished": 0, "oldest_age_s": None, "by_topic_role": {}},
        "late_jobs": {
            "matched": 1,
            "rows": [{"operation_id": "op-late", "remote_job_id": "job<b>", "state": "rejected", "learned_age_s": 5.0}],
        },
    }


def test_overview_escapes_every_value() -> None:
    page = web.render_overview(
        _overview(),
        worker="w<1>",
        counters=[{"name": "streams_dead_letters_total", "labels": {"reason": "<i>x</i>", "topic": "t"}, "value": 2.0}],
        dead_letters={"topic": "<u>dl</u>", "retained": 3, "by_partition": {0: 3}, "error": None},
    )
    parser = _Text()
    parser.feed(page)
    assert "script" not in parser.tags and "b" not in parser.tags and "i" not in parser.tags
    text = "".join(parser.text)
    assert HOSTILE in text and "w<1>" in text and "reason=<i>x</i>" in text and "3 records on <u>dl</u>" in text
    assert "u" not in parser.tags
    assert 'href="/operations/op%3C1%3E%22"' in page
    assert '<span id="late-jobs-count">1</span> jobs not observed' in page and "job<b>" in text
    unreachable: dict[str, object] = {
        "topic": "t",
        "retained": None,
        "by_partition": {},
        "error": "KafkaConnectionError: <down>",
    }
    page = web.render_overview(_overview(), worker="w", counters=[], dead_letters=unreachable)
    assert "Kafka did not answer for t: KafkaConnectionError: &lt;down&gt;" in page


def test_throughput_minutes_are_the_window() -> None:
    now = dt.datetime(2026, 5, 2, 10, 0, 30, tzinfo=dt.UTC)
    minute = dt.datetime(2026, 5, 2, 9, 59, tzinfo=dt.UTC)
    rows = [
        {"minute": minute, "to_state": "accepted", "transitions": 5},
        {"minute": minute, "to_state": "succeeded", "transitions": 3},
        {"minute": minute, "to_state": "rejected", "transitions": 1},
        {"minute": minute, "to_state": "submitted", "transitions": 4},
    ]
    tp = operators._throughput(now, 3, rows)
    assert [m["minute"].strftime("%H:%M") for m in tp["minutes"]] == ["09:58", "09:59", "10:00"]
    assert [(m["accepted"], m["finished"]) for m in tp["minutes"]] == [(0, 0), (5, 4), (0, 0)]
    assert tp["finished"] == 4 and tp["finished_per_s"] == pytest.approx(4 / 150)


def test_operation_path_encodes_the_id() -> None:
    assert web.operation_path("run-1:conv/000001") == "/operations/run-1%3Aconv%2F000001"
