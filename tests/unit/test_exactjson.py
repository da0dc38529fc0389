"""Exact JSON: every number read and written unchanged, or refused with a reason naming the field."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import orjson
import pytest

from streams.errors import JsonValueError
from streams.wire import exactjson

TWO_64 = 2**64


def test_what_the_installed_orjson_does() -> None:
    """Why the project does not read JSON with orjson: seen, not assumed (orjson 3.x)."""
    assert orjson.loads(b"18446744073709551615") == TWO_64 - 1  # the widest int orjson keeps
    assert isinstance(orjson.loads(b"18446744073709551616"), float)  # 2**64 becomes a double ...
    assert orjson.loads(b"18446744073709551616") == orjson.loads(b"18446744073709551617")  # ... 2**64 + 1 too
    assert isinstance(orjson.loads(b"-9223372036854775809"), float)
    assert orjson.loads(b"0.1000000000000000055511151231257827") == 0.1  # a long fraction is rounded
    for token in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(token)
    with pytest.raises(orjson.JSONEncodeError, match="64-bit"):
        orjson.dumps(TWO_64)
    assert orjson.dumps(float("nan")) == b"null"  # and a NaN float is written as null, silently


# input text -> (Python value, text written back by dumps)
EXACT: list[tuple[bytes, Any, bytes]] = [
    (b"18446744073709551616", TWO_64, b"18446744073709551616"),
    (b"18446744073709551617", TWO_64 + 1, b"18446744073709551617"),
    (b"-9223372036854775809", -(2**63) - 1, b"-9223372036854775809"),
    (b"123456789012345678901234567890", 123456789012345678901234567890, b"123456789012345678901234567890"),
    (b'{"seed": 18446744073709551616}', {"seed": TWO_64}, b'{"seed":18446744073709551616}'),
    (b"[9007199254740993]", [9007199254740993], b"[9007199254740993]"),  # 2**53 + 1: not a double
    (
        b"0.1000000000000000055511151231257827",
        Decimal("0.1000000000000000055511151231257827"),
        b"0.1000000000000000055511151231257827",
    ),
    (b"1.50", Decimal("1.50"), b"1.50"),
    (b"1e400", Decimal("1e400"), b"1E+400"),
    (b"1E-400", Decimal("1e-400"), b"1E-400"),
    (b"-0.0", Decimal("-0.0"), b"-0.0"),
    (b"5.0", Decimal("5.0"), b"5.0"),
    (b"1" + b"0" * 4299, 10**4299, b"1" + b"0" * 4299),  # 4300 digits: the limit
    (
        b'{"a": [1, {"b": 2.25}], "c": null, "d": true, "e": "x"}',
        {"a": [1, {"b": Decimal("2.25")}], "c": None, "d": True, "e": "x"},
        b'{"a":[1,{"b":2.25}],"c":null,"d":true,"e":"x"}',
    ),
    (b'"\\ud83d\\ude00"', "\U0001f600", '"\U0001f600"'.encode()),
]


@pytest.mark.parametrize(("text", "value", "written"), EXACT, ids=[e[0][:40].decode() for e in EXACT])
def test_numbers_round_trip_exactly(text: bytes, value: Any, written: bytes) -> None:
    parsed = exactjson.loads(text)
    assert parsed == value
    assert type(parsed) is type(value) or (isinstance(parsed, Decimal) and isinstance(value, Decimal))
    assert exactjson.dumps(parsed) == written
    assert exactjson.loads(exactjson.dumps(parsed)) == value  # and read back again, the same value


def test_two_to_the_64_and_the_next_integer_stay_apart() -> None:
    both = exactjson.loads(b"[18446744073709551616, 18446744073709551617]")
    assert both == [TWO_64, TWO_64 + 1]
    assert exactjson.dumps(both) == b"[18446744073709551616,18446744073709551617]"


def test_decimal_repr_is_its_json_text() -> None:
    value = exactjson.loads(b"[1.5]")[0]
    assert repr(value) == "1.5" and isinstance(value, Decimal)


# input text -> (reason, path, words of the message)
REFUSED: list[tuple[bytes, str, str | None, str]] = [
    (b"NaN", "not_json", "(root)", "NaN is not a JSON number"),
    (b'{"outputs": [{"id": "o", "score": NaN}]}', "not_json", "outputs/0/score", "NaN is not a JSON number"),
    (b'{"poll_after_ms": Infinity}', "not_json", "poll_after_ms", "Infinity is not a JSON number"),
    (b'{"completed_at": -Infinity}', "not_json", "completed_at", "-Infinity is not a JSON number"),
    (b'{"n": [1e5000]}', "number_out_of_range", "n/0", "5001 digits written out"),
    (b'{"n": 1' + b"0" * 4300 + b"}", "number_out_of_range", "n", "an integer of 4301 digits"),
    (b"[" + b",".join([b"1e4000"] * 20) + b"]", "number_out_of_range", "16", "grow the text"),
    (b'{"s": "\\ud800"}', "not_json", "s", "unpaired surrogate"),
    (b'{"\\udfff": 1}', "not_json", "(root)", "unpaired surrogate"),
    (b"\xff\xfe{}", "not_json", None, "not UTF-8"),
    (b'{"a": 1', "not_json", None, "not JSON"),
    (b"", "not_json", None, "not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "too_deep", "(root)", "nested more than 64 levels deep"),
    (b"[" * 65 + b"]" * 65, "too_deep", "(root)", "nested more than 64 levels deep"),
    (b'{"a": ' * 65 + b"1" + b"}" * 65, "too_deep", "(root)", "nested more than 64 levels deep"),
    # in a value that a repeated key replaces: still refused, naming that field
    (b'{"a": NaN, "a": 1}', "not_json", "a", "NaN is not a JSON number"),
    (b'[{"a": {"b": [1e5000]}, "a": 1}]', "number_out_of_range", "0/a/b/0", "5001 digits written out"),
]


@pytest.mark.parametrize(
    ("text", "reason", "path", "words"), REFUSED, ids=[r[0][:30].decode("latin-1") for r in REFUSED]
)
def test_values_that_cannot_be_carried_exactly_are_refused_naming_the_field(
    text: bytes, reason: str, path: str | None, words: str
) -> None:
    with pytest.raises(JsonValueError) as info:
        exactjson.loads(text)
    assert (info.value.reason, info.value.path) == (reason, path)
    assert words in str(info.value)
    if path is not None and reason != "too_deep":
        assert str(info.value).startswith(f"at {path}: ")


def test_dumps_refuses_what_json_cannot_hold() -> None:
    with pytest.raises(TypeError) as info:
        exactjson.dumps({"x": Decimal("NaN")})
    assert "NaN cannot be written as a JSON number" in str(info.value.__cause__)
    with pytest.raises(TypeError):
        exactjson.dumps({"x": object()})


@pytest.mark.parametrize("levels", [exactjson.MAX_DEPTH - 1, exactjson.MAX_DEPTH])
def test_documents_at_the_depth_limit_are_read_and_written_back(levels: int) -> None:
    text = b'{"a":' * levels + b"18446744073709551616" + b"}" * levels  # a wide int: dumps' second writer too
    assert exactjson.depth(exactjson.loads(text)) == levels
    assert exactjson.dumps(exactjson.loads(text)) == text


def test_dumps_refuses_what_orjson_cannot_nest_without_recursing() -> None:
    value: list[object] = [2**70]
    for _ in range(100_000):
        value = [value]
    with pytest.raises(TypeError, match="nested 100001 levels deep cannot be written"):
        exactjson.dumps(value)


def test_dumps_writes_wide_ints_anywhere_in_the_document() -> None:
    value = {"a": [1, {"b": -(2**70)}], "c": (2**64, True)}
    assert exactjson.dumps(value) == b'{"a":[1,{"b":-1180591620717411303424}],"c":[18446744073709551616,true]}'


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, True), (Decimal("1.5"), True), (1.5, True), (True, False), ("1", False), (None, False)],
)
def test_is_number(value: Any, expected: bool) -> None:
    assert exactjson.is_number(value) is expected


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (b'{"a": 1, "a": 1}', "a"),
        (b'{"a": {"b": [{"c": 1, "c": 2}]}}', "a/b/0/c"),
        (b'{"\\u00e9": 1, "\xc3\xa9": 2}', "\u00e9"),  # the same key, written two ways
    ],
)
def test_repeated_keys_are_refused_on_request_naming_the_field(text: bytes, where: str) -> None:
    with pytest.raises(JsonValueError) as info:
        exactjson.loads(text, unique_keys=True)
    assert (info.value.reason, info.value.path) == ("not_json", where)
    assert "appears twice in one object" in str(info.value)
    assert exactjson.loads(text) is not None  # the default reads them (the last one counts), as orjson does


@pytest.mark.parametrize(
    ("text", "path"), [('["\ud800"]', "0"), ('{"\udfff": 1}', "(root)"), ('{"a": "x\ud83d"}', "a")]
)
def test_a_str_holding_an_unpaired_surrogate_is_refused_naming_the_field(text: str, path: str) -> None:
    """A str given to loads (a line of a file, a text spliced into a submission) is held to the same rule as an
    escaped surrogate: no UTF-8 text can hold it."""
    for unique_keys in (False, True):
        with pytest.raises(JsonValueError) as info:
            exactjson.loads(text, unique_keys=unique_keys)
        assert (info.value.reason, info.value.path) == ("not_json", path)
        assert "unpaired surrogate" in str(info.value)
