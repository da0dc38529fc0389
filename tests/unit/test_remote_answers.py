"""Reading the remote API's answers: numbers exact, NaN named, completed_at and Retry-After read as tabled."""

from __future__ import annotations

import datetime as dt
import email.utils
import random
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from typing import Any

import httpx
import pytest

from streams.backoff import next_poll_delay_s
from streams.config import Settings
from streams.errors import (
    RemoteContractError,
    RemoteRateLimitedError,
    RemoteTransientError,
    RemoteUnknownOutcomeError,
)
from streams.remote.client import UNDATED_RETRY_AFTER_CAP_S, RemoteClient, make_http_client, parse_retry_after_s

OP = "op-numbers"
REQUEST = '{"input": {"prompt": "p", "max_tokens": 1}}'

Client = Callable[[int, bytes, dict[str, str] | None], RemoteClient]


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    made: list[RemoteClient] = []

    def factory(status: int, body: bytes, headers: dict[str, str] | None = None) -> RemoteClient:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body, headers=headers))
        c = RemoteClient(make_http_client(Settings(), transport=transport), "sim-1")
        made.append(c)
        return c

    yield factory
    for c in made:
        await c.aclose()


# --- GET answers: numbers ----------------------------------------------------------------------------------------

SUCCEEDED = b'{"id": "job-1", "status": "succeeded", "completed_at": 1700000000.5, "outputs": [{"id": "o", %s}]}'

# the members of output "o" -> its exact value in the snapshot, or (error type, words of the reason)
GET_ANSWERS: list[tuple[bytes, Any]] = [
    (b'"seed": 18446744073709551616', {"id": "o", "seed": 2**64}),
    (b'"seed": 18446744073709551617', {"id": "o", "seed": 2**64 + 1}),
    (b'"seed": -18446744073709551617', {"id": "o", "seed": -(2**64) - 1}),
    (b'"p": 0.1000000000000000055511151231257827', {"id": "o", "p": Decimal("0.1000000000000000055511151231257827")}),
    (b'"big": 1e400, "small": 1e-400', {"id": "o", "big": Decimal("1e400"), "small": Decimal("1e-400")}),
    (b'"score": NaN', (RemoteContractError, "at outputs/0/score: NaN is not a JSON number")),
    (b'"score": Infinity', (RemoteContractError, "at outputs/0/score: Infinity is not a JSON number")),
    (b'"score": -Infinity', (RemoteContractError, "at outputs/0/score: -Infinity is not a JSON number")),
    (b'"score": 1e5000', (RemoteContractError, "at outputs/0/score: 1e5000 has 5001 digits written out")),
    (b'"text": "\\ud800"', (RemoteContractError, "at outputs/0/text: a string with an unpaired surrogate")),
]


@pytest.mark.parametrize(("members", "outcome"), GET_ANSWERS, ids=[a[0].decode() for a in GET_ANSWERS])
async def test_get_answer_numbers_are_exact_or_a_named_contract_violation(
    client: Client, members: bytes, outcome: Any
) -> None:
    remote = client(200, SUCCEEDED % members, None)
    if isinstance(outcome, tuple):
        error, words = outcome
        with pytest.raises(error) as info:
            await remote.observe(OP, "job-1")
        assert str(info.value).startswith(
            f"operation {OP}: GET job-1 answered HTTP 200 with a value that cannot be carried exactly: {words}"
        )
        assert info.value.status_code == 200
        return
    snapshot = await remote.observe(OP, "job-1")
    assert snapshot.outputs == [outcome]
    for key, value in outcome.items():
        got = snapshot.outputs[0][key]
        assert isinstance(got, Decimal) if isinstance(value, Decimal) else type(got) is type(value)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b'{"status": "running", "poll_after_ms": NaN}', "at poll_after_ms: NaN is not a JSON number"),
        (b'{"status": "succeeded", "completed_at": Infinity, "outputs": []}', "at completed_at: Infinity"),
        (b'{"status": "failed", "error": {"code": "x", "retry_in": -Infinity}}', "at error/retry_in: -Infinity"),
    ],
)
async def test_nan_anywhere_in_a_get_answer_is_a_contract_violation(client: Client, body: bytes, words: str) -> None:
    with pytest.raises(RemoteContractError, match="cannot be carried exactly") as info:
        await client(200, body, None).observe(OP, "job-1")
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"<html>busy</html>", "not JSON: Expecting value"),
        (b'{"status": "running"', "not JSON: Expecting ',' delimiter"),
        (b"\xff\xfe", "not JSON: not UTF-8"),
        (b"[1, 2]", "JSON that is not an object"),
    ],
)
async def test_a_get_200_that_is_not_json_is_retried_saying_why(client: Client, body: bytes, words: str) -> None:
    with pytest.raises(RemoteTransientError) as info:
        await client(200, body, None).observe(OP, "job-1")
    assert f"GET job-1 answered HTTP 200 with {words}" in str(info.value)


@pytest.mark.parametrize(
    ("status", "body", "words"),
    [
        (
            201,
            b'{"id": "job-1", "poll_after_ms": NaN}',
            "HTTP 201 without a usable job id (None) (body not read: at poll_after_ms: NaN is not a JSON number",
        ),
        (201, b'{"id": "job-1", "poll_after_ms": 1e5000}', "(body not read: at poll_after_ms: 1e5000 has 5001"),
        (
            502,
            b'{"error": {"job_id": "job-1", "x": Infinity}}',
            "HTTP 502 without error.job_id (body not read: at error/x: Infinity is not a JSON number",
        ),
    ],
)
async def test_a_post_answer_that_cannot_be_read_exactly_is_an_unknown_outcome_naming_the_field(
    client: Client, status: int, body: bytes, words: str
) -> None:
    with pytest.raises(RemoteUnknownOutcomeError) as info:
        await client(status, body, None).submit(OP, REQUEST)
    assert words in str(info.value) and "a job may exist" in str(info.value)


async def test_post_body_numbers_are_sent_exactly() -> None:
    sent: list[bytes] = []

    def respond(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(201, content=b'{"id": "job-1"}')

    remote = RemoteClient(make_http_client(Settings(), transport=httpx.MockTransport(respond)), "sim-1")
    await remote.submit(OP, '{"input": {"seed": 18446744073709551616, "max_tokens": 5.0, "t": 1e400}}')
    await remote.aclose()
    assert sent[0].startswith(b'{"input": {"seed": 18446744073709551616, "max_tokens": 5.0, "t": 1e400},')


# --- completed_at ------------------------------------------------------------------------------------------------

# completed_at as it comes in the answer (JSON text) -> (epoch ms, words of the reason it was not read)
COMPLETED_AT: list[tuple[bytes, int | None, str | None]] = [
    (b"null", None, None),
    (b"1700000000.123", 1700000000123, None),
    (b"1700000000.1239", 1700000000123, None),  # sub-millisecond digits dropped
    (b"1700000000123", 1700000000123, None),
    (b"0", 0, None),
    (b'"2023-11-14T22:13:20.123Z"', 1700000000123, None),
    (b'"2023-11-14T23:13:20.123+01:00"', 1700000000123, None),
    (b'"2023-11-14t22:13:20.123z"', 1700000000123, None),
    (b'"2023-11-14T22:13:20.123456789Z"', 1700000000123, None),
    (b'"2023-11-14T22:13:20.123"', None, "completed_at '2023-11-14T22:13:20.123' has no UTC offset"),
    (b'"2023-11-14T22:13:20"', None, "has no UTC offset (RFC 3339 requires Z or +hh:mm); not read"),
    (b'"2023-11-14"', None, "completed_at '2023-11-14' is not an RFC 3339 date-time; not read"),
    (b'"2023-11-14 22:13:20Z"', None, "is not an RFC 3339 date-time"),
    (b'"yesterday"', None, "completed_at 'yesterday' is not an RFC 3339 date-time; not read"),
    (b'"1969-12-31T23:59:59Z"', None, "is outside 1970-01-01 .. 9999-12-31"),
    (b"-5", None, "completed_at -5 is outside 1970-01-01 .. 9999-12-31; not read"),
    (b"1e20", None, "completed_at 1E+20 is outside"),
    (b"18446744073709551616", None, "completed_at 18446744073709551616 is outside"),
    (b"true", None, "completed_at True is neither a number nor a date-time; not read"),
    (b"[1]", None, "is neither a number nor a date-time"),
]


@pytest.mark.parametrize(("text", "ms", "words"), COMPLETED_AT, ids=[c[0].decode() for c in COMPLETED_AT])
def test_completed_at_is_read_or_its_reason_given(text: bytes, ms: int | None, words: str | None) -> None:
    from streams.remote.client import read_completed_at_ms
    from streams.wire import exactjson

    got_ms, problem = read_completed_at_ms(exactjson.loads(text))
    assert got_ms == ms
    if words is None:
        assert problem is None
    else:
        assert problem is not None and words in problem


async def test_an_unreadable_completed_at_is_recorded_with_the_observation(client: Client) -> None:
    body = b'{"status": "succeeded", "completed_at": "2023-11-14T22:13:20", "outputs": [{"id": "o"}]}'
    snapshot = await client(200, body, None).observe(OP, "job-1")
    assert snapshot.completed_at_ms is None
    assert snapshot.as_observation()["completed_at_problem"] == (
        "completed_at '2023-11-14T22:13:20' has no UTC offset (RFC 3339 requires Z or +hh:mm); not read"
    )
    assert snapshot.outputs == [{"id": "o"}]  # the outputs are still delivered


# --- Retry-After ---------------------------------------------------------------------------------------------------

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
BASE_S, CAP_S, MIN_S = 0.5, 30.0, 0.05
FALLBACK = "fallback"  # the capped exponential with jitter, as if there were no hint


def http_date(offset_s: int) -> str:
    return email.utils.format_datetime(NOW + dt.timedelta(seconds=offset_s), usegmt=True)


# Retry-After header -> (seconds read, next poll delay (cap 30 s, floor 0.05 s), wait before re-POSTing a 429)
RETRY_AFTER: list[tuple[str | None, float | None, float | str, float]] = [
    ("-1", None, FALLBACK, 1.0),
    (http_date(90), 90.0, CAP_S, 90.0),
    (http_date(10), 10.0, 10.0, 10.0),
    (http_date(-90), 0.0, MIN_S, 0.0),
    ("86400000", 3600.0, CAP_S, 3600.0),
    ("nan", None, FALLBACK, 1.0),
    ("1e999", None, FALLBACK, 1.0),
    ("120 ", 120.0, CAP_S, 120.0),
    (None, None, FALLBACK, 1.0),
    ("12345678901234567890", 3600.0, CAP_S, 3600.0),
    ("2.5", 2.5, 2.5, 2.5),
    ("0", 0.0, MIN_S, 0.0),
    ("inf", None, FALLBACK, 1.0),
    ("", None, FALLBACK, 1.0),
]


@pytest.mark.parametrize("skew_s", [-120, 0, 120])
def test_an_http_date_is_read_against_the_answers_date_not_the_workers_clock(skew_s: int) -> None:
    # The provider's clock says NOW and asks for 30 s; a worker whose clock is 120 s off either way waits 30 s
    # (the old reading gave 0 s ahead, 150 s behind).
    worker_now = NOW + dt.timedelta(seconds=skew_s)
    assert parse_retry_after_s(http_date(30), date=http_date(0), now=worker_now) == 30.0
    assert parse_retry_after_s(http_date(30), date=f"  {http_date(0)} ", now=worker_now) == 30.0


@pytest.mark.parametrize("date", [None, "", "yesterday", "Mon, 99 Foo 2024 99:99:99 GMT"])
def test_without_a_usable_date_the_workers_clock_is_used_and_bounded(date: str | None) -> None:
    assert parse_retry_after_s(http_date(30), date=date, now=NOW) == 30.0
    assert parse_retry_after_s(http_date(150), date=date, now=NOW) == UNDATED_RETRY_AFTER_CAP_S
    assert parse_retry_after_s(http_date(-150), date=date, now=NOW) == 0.0
    assert parse_retry_after_s("150", date=date, now=NOW) == 150.0  # delay-seconds need no clock


def test_only_ascii_digits_are_delay_seconds() -> None:
    assert parse_retry_after_s("\u0663", now=NOW) is None  # ARABIC-INDIC DIGIT THREE (a str header, not wire)


@pytest.mark.parametrize(
    ("header", "seconds", "poll_delay", "post_wait"), RETRY_AFTER, ids=[repr(r[0]) for r in RETRY_AFTER]
)
def test_retry_after_table(
    header: str | None, seconds: float | None, poll_delay: float | str, post_wait: float
) -> None:
    # read against the answer's Date (NOW), whatever the worker's clock says
    assert parse_retry_after_s(header, date=http_date(0), now=NOW + dt.timedelta(hours=5)) == seconds
    delay = next_poll_delay_s(0, seconds, base_s=BASE_S, cap_s=CAP_S, min_s=MIN_S, rng=random.Random(3))
    if poll_delay == FALLBACK:
        assert delay == next_poll_delay_s(0, None, base_s=BASE_S, cap_s=CAP_S, min_s=MIN_S, rng=random.Random(3))
        assert BASE_S / 2 <= delay <= BASE_S
    else:
        assert delay == poll_delay


@pytest.mark.parametrize(
    ("header", "seconds", "poll_delay", "post_wait"), RETRY_AFTER, ids=[repr(r[0]) for r in RETRY_AFTER]
)
async def test_retry_after_on_the_wire(
    client: Client, header: str | None, seconds: float | None, poll_delay: float | str, post_wait: float
) -> None:
    """The same parser on every path: 429 to a POST, 429 to a GET, the hint of a GET 200; an HTTP-date read
    against the answer's own ``Date`` (NOW on the provider's clock, not the test's wall clock)."""
    headers = {"Retry-After": header, "Date": http_date(0)} if header is not None else None
    with pytest.raises(RemoteRateLimitedError) as post:
        await client(429, b"{}", headers).submit(OP, REQUEST)
    with pytest.raises(RemoteRateLimitedError) as get:
        await client(429, b"{}", headers).observe(OP, "job-1")
    running = await client(200, b'{"status": "running"}', headers).observe(OP, "job-1")
    assert [post.value.retry_after_s, get.value.retry_after_s] == [post_wait, post_wait]
    assert running.poll_after_s == seconds


@pytest.mark.parametrize(
    ("hint", "expected"),
    [(float("nan"), FALLBACK), (float("inf"), CAP_S), (-float("inf"), MIN_S), (-1.0, MIN_S), (None, FALLBACK)],
)
def test_backoff_never_before_now_never_past_the_cap(hint: float | None, expected: float | str) -> None:
    delay = next_poll_delay_s(4, hint, base_s=BASE_S, cap_s=CAP_S, min_s=MIN_S, rng=random.Random(9))
    if expected == FALLBACK:
        assert delay == next_poll_delay_s(4, None, base_s=BASE_S, cap_s=CAP_S, min_s=MIN_S, rng=random.Random(9))
        assert 4.0 <= delay <= 8.0  # poll 4: ceiling 0.5 * 2**4 = 8 s, half of it fixed
    else:
        assert delay == expected


@pytest.mark.parametrize(
    ("poll_after_ms", "seconds"),
    [
        (b"250", 0.25),
        (b"-5", 0.0),
        (b"1e400", 3600.0),
        (b"18446744073709551616", 3600.0),
        (b'"250"', None),
        # integers past a float's range: float() raised OverflowError out of observe
        (b"9" * 400, 3600.0),
        (b"-" + b"9" * 400, 0.0),
    ],
)
async def test_poll_after_ms_hint(client: Client, poll_after_ms: bytes, seconds: float | None) -> None:
    snapshot = await client(200, b'{"status": "running", "poll_after_ms": %s}' % poll_after_ms, None).observe(OP, "j")
    assert snapshot.poll_after_s == seconds
