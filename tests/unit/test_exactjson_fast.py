"""The fast path of exactjson.loads (orjson) against the reference parser: the same value or the same error.

Documents are generated from a fixed seed (numbers of every shape, strings with escapes and surrogates, repeated
keys, nesting, blanks, damaged texts), so a failure names a document that can be read again.
"""

from __future__ import annotations

import inspect
import random
import sys
from decimal import Decimal
from typing import Any

import orjson
import pytest

from streams.errors import JsonValueError
from streams.wire import exactjson


def test_what_orjson_reads_differently_from_the_reference() -> None:
    """What the fast path has to catch, seen on the installed orjson (3.x)."""
    assert type(orjson.loads(b"1.50")) is float and type(orjson.loads(b"1E+2")) is float
    assert type(orjson.loads(b"18446744073709551615")) is int
    assert type(orjson.loads(b"18446744073709551616")) is float
    assert type(orjson.loads(b"-9223372036854775808")) is int
    assert type(orjson.loads(b"-9223372036854775809")) is float
    pairs = list(orjson.loads(b'{"a": 1, "b": 2, "a": 3}').items())
    assert pairs == [("a", 3), ("b", 2)] == list(exactjson.reference_loads(b'{"a": 1, "b": 2, "a": 3}').items())
    deep = b"[" * 1024 + b"]" * 1024
    assert isinstance(orjson.loads(deep), list)  # both refuse it: over the depth limit
    with pytest.raises(JsonValueError, match="nested more than 64 levels deep"):
        exactjson.reference_loads(deep)
    with pytest.raises(JsonValueError, match="nested more than 64 levels deep"):
        exactjson.loads(deep)
    # Refused by orjson, as by the reference: the fast path never returns a value for these.
    for text in (b'"\\ud800"', b'"\\udc00\\ud800"', b"\xef\xbb\xbf{}", "\ufeff{}", b'"\x01"', b"NaN", b"{} x", b"\xff"):
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(text)
        with pytest.raises(JsonValueError):
            exactjson.reference_loads(text)


def _shape(value: Any) -> Any:
    """``value`` with every type and order visible: ``1`` and ``True``, ``1.5`` and ``1.50``, key orders differ."""
    if isinstance(value, dict):
        return ("object", [(k, _shape(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("array", [_shape(v) for v in value])
    if isinstance(value, Decimal):
        return (type(value).__name__, str(value))
    return (type(value).__name__, value)


def _outcome(loads: Any, text: bytes | str, unique_keys: bool) -> Any:
    try:
        return ("value", _shape(loads(text, unique_keys=unique_keys)))
    except JsonValueError as exc:
        return ("refused", type(exc).__name__, exc.reason, exc.path, str(exc))


def _assert_same(text: bytes | str) -> None:
    for unique_keys in (False, True):
        fast = _outcome(exactjson.loads, text, unique_keys)
        reference = _outcome(exactjson.reference_loads, text, unique_keys)
        assert fast == reference, f"unique_keys={unique_keys} text={text!r}"


_NUMBERS = [
    "0", "-0", "7", "-12", "9223372036854775807", "-9223372036854775808", "-9223372036854775809",
    "18446744073709551615", "18446744073709551616", "18446744073709551617", "-9999999999999999999",
    "9999999999999999999", "123456789012345678901234567890", "-123456789012345678901234567890",
    "1.5", "1.50", "-0.0", "0.0", "5.0", "0.1000000000000000055511151231257827", "1E+2", "1e2", "1E2", "-1e-7",
    "1.25e+10", "1e400", "1E-400", "1e5000", "1e4000", "1e-5000", "NaN", "Infinity", "-Infinity",
    "1764500000.123456", "2.5E-3",
]  # fmt: skip
_PIECES = [
    "a", "b", "z", "é", "\U0001f600", " ", ":", ",", "{", "]", "0", "1.5", "e2", "\\\"", "\\\\", "\\/", "\\n",
    "\\t", "\\u00e9", "\\u0061", "\\u003a", "\\u0022", "\\ud83d\\ude00", "\\uD83D\\uDE00", "\\ud800", "\\udfff",
    "\\ud800\\u0041", "\x7f", "\u2028",
]  # fmt: skip
_RARE_PIECES = ["\x01", "\\x", "\\u12", "\\"]  # not JSON inside a string
_KEYS = ['"a"', '"b"', '"\\u0061"', '"a:b"', '"\\"q"', '"\\\\"', '"c"', '"\\ud800"', '""']
_BLANKS = ["", "", "", " ", "\n", "\t", "\r\n", "  "]


class _Documents:
    """JSON-ish texts from one seed: mostly valid, some with a flaw the reference names."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def blank(self) -> str:
        return self.rng.choice(_BLANKS) if self.rng.random() < 0.97 else self.rng.choice(["\x0c", "\x0b", "\xa0"])

    def string(self) -> str:
        rng = self.rng
        pieces = [rng.choice(_PIECES) for _ in range(rng.randrange(0, 5))]
        if rng.random() < 0.02:
            pieces.insert(rng.randrange(len(pieces) + 1), rng.choice(_RARE_PIECES))
        return '"' + "".join(pieces) + '"'

    def number(self) -> str:
        rng = self.rng
        roll = rng.random()
        if roll < 0.4:
            return str(rng.randrange(-1000, 10**15))
        if roll < 0.45:
            return str(rng.choice([-1, 1]) * rng.randrange(10**18, 10**21))
        if roll < 0.47:
            return "1" + "0" * rng.choice([4298, 4299, 4300])
        if roll < 0.48:
            return rng.choice(["1e4000", "1E+4000"])  # many of them grow the text too much
        return rng.choice(_NUMBERS)

    def value(self, depth: int) -> str:
        rng = self.rng
        roll = rng.random()
        if depth < 6 and roll < 0.3:
            members = [
                self.blank() + rng.choice(_KEYS if rng.random() < 0.6 else [self.string()]) + self.blank() + ":"
                + self.blank() + self.value(depth + 1) + self.blank()
                for _ in range(rng.randrange(0, 5))
            ]  # fmt: skip
            return "{" + ",".join(members) + self.blank() + "}"
        if depth < 6 and roll < 0.5:
            items = [self.blank() + self.value(depth + 1) + self.blank() for _ in range(rng.randrange(0, 5))]
            return "[" + ",".join(items) + self.blank() + "]"
        if roll < 0.75:
            return self.number()
        if roll < 0.93:
            return self.string()
        return rng.choice(["true", "false", "null"])

    def document(self) -> bytes | str:
        rng = self.rng
        text = (self.blank() + self.value(0) + self.blank()).encode()
        roll = rng.random()
        if roll < 0.01:
            text = text[: rng.randrange(len(text) + 1)]
        elif roll < 0.02:
            text += rng.choice([b" x", b"{}", b",", b"\x00"])
        elif roll < 0.025:
            text = b"\xef\xbb\xbf" + text
        elif roll < 0.03:
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice([b"\xff", b"\xed\xa0\x80", b"\xc3"]) + text[at:]
        return text.decode("utf-8", "surrogatepass") if rng.random() < 0.3 and roll >= 0.03 else text


@pytest.mark.parametrize("seed", range(8))
def test_loads_agrees_with_the_reference_on_generated_documents(seed: int) -> None:
    documents = _Documents(seed)
    outcomes: dict[str, int] = {}
    for _ in range(2500):
        text = documents.document()
        _assert_same(text)
        kind = _outcome(exactjson.reference_loads, text, True)[0]
        outcomes[kind] = outcomes.get(kind, 0) + 1
    assert outcomes.get("value", 0) > 500 and outcomes.get("refused", 0) > 200  # both sides were exercised


@pytest.mark.parametrize(
    "text",
    [
        b"[" * 200 + b"]" * 200,
        b"[" * 201 + b"]" * 201,
        b"[" * 990 + b"]" * 990,
        b"[" * 1024 + b"]" * 1024,
        b"[" + b"[1]," * 300 + b"[2]]",  # many containers, shallow
        b'{"a": {"a": 1}}',
        b'{"a": [{"b": 1}, {"b": 2, "b": 3}]}',
        b'{"a\\"": 1, "a\\"": 2}',  # an escaped quote: the colons decide
        b'{"a\\"": "x:y", "a\\"": 2}',  # an escaped quote and a colon in a string: the reference decides
        b'{"\\u0061": 1, "a": 2}',
        b'{"a": "\\"", "b": 1}',
        b'{"x": "\\\\", "x": 1}',
        b'{"t": "12:00", "u": "https://h/p"}',
        b'{"n": -9223372036854775809, "m": 1}',
        b'{"n": 18446744073709551615}',
        '{"s": "\ud800"}'.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass"),
        '"\ud83d\ude00"',
        b'"\\ud83d\\ude00"',
        "\ufeff{}",
        b" \t\r\n{} \t\r\n",
        b"-0",
        b"[-0, -0.0, 0e0, 0E-0]",
        b"[" + b",".join([b"1e4000"] * 16) + b"]",  # grows the text by 63,904 characters: under the limit
        b"[" + b",".join([b"1e4000"] * 17) + b"]",  # over it
        b"[" + b",".join([b"1.5e4000"] * 16 + [b"1e4"] * 200) + b"]",
        b"[1e4000" + b",1e4000" * 15 + b",1e1621]",  # grows the text by 65,536 characters: the limit
        b"[1e4000" + b",1e4000" * 15 + b",1e1622]",
        b"[" + b",".join([b"1e+300"] * 222) + b"]",  # compact, as orjson writes it: grows the text by 65,490
        b"[" + b",".join([b"1e+300"] * 223) + b"]",  # 65,785: over the limit
        b'{"a":[1.5,-0.0,1e-7,{"b":1.7645e+300}],"c":1764500000.123456}',
        b'{"a":1.5,"a":2.5}',
        b"[" * 230 + b"1.5" + b"]" * 230,
        b"1.5",
        b"1e+300",
        b"[1e4299, 1E-4298]",
        b"[1e4300]",
        b"[0." + b"0" * 4298 + b"1]",  # 4300 digits written out
        b"[0." + b"0" * 4299 + b"1]",  # 4301
        b"[-0." + b"0" * 4299 + b"1]",
        b"[1" + b"0" * 4299 + b", -1" + b"0" * 4299 + b"]",
        b"[-1" + b"0" * 4300 + b"]",
    ],
)
def test_loads_agrees_with_the_reference_at_the_edges(text: bytes | str) -> None:
    _assert_same(text)


def _reader(monkeypatch: pytest.MonkeyPatch, text: bytes | str, unique_keys: bool = True) -> str:
    """Which reader gave the value of ``loads(text)`` (or its error): orjson, plain hooks or the reference."""
    called: list[str] = []
    for name, label in (("_read_plainly", "plain"), ("reference_loads", "reference")):
        original = getattr(exactjson, name)

        def spy(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            called.append(_label)
            return _original(*args, **kwargs)

        monkeypatch.setattr(exactjson, name, spy)
    try:
        exactjson.loads(text, unique_keys=unique_keys)
    except JsonValueError:
        pass
    monkeypatch.undo()
    return called[-1] if called else "orjson"


POLL = b'{"operation_id":"op-1","remote_job_id":"job_1","poll_claim_id":9223372036854775807,"claimed_at_ms":1}'


@pytest.mark.parametrize(
    ("text", "reader"),
    [
        (POLL, "orjson"),
        (POLL.decode(), "orjson"),  # jsonb arrives as str
        (b'{"a": "say \\"hi\\"", "c": [18446744073709551615]}', "orjson"),  # repeats no key: the colons say so
        (b'{"a": "12:00", "b": {"c": "https://h/p"}}', "orjson"),  # the quotes say so
        (b'{"a": "\\"12:00"}', "plain"),  # neither can say: the hooks read it
        (b'{"a": 1.5, "b": 1E+2, "c": 1e-7, "d": 18446744073709551616}', "plain"),
        (b"[1e4000]", "reference"),  # beyond a double: orjson refuses it
        (b"[" + b",".join([b"1e300"] * 221) + b"]", "plain"),  # grows the text by 65,416 characters
        (b"[" + b",".join([b"1e300"] * 222) + b"]", "reference"),  # by 65,712: refused
        (b"[0." + b"0" * 4298 + b"1]", "plain"),  # 4300 digits written out
        (b'{"a":1.5,"b":[1e-7,-0.0],"c":"x"}', "orjson"),  # floats in compact text from orjson: as written
        (b'{"a": 1.5}', "plain"),  # not as orjson writes it
        (b'{"a":1.50}', "plain"),
        (b'{"a": 1, "a": 2}', "reference"),
        (b'{"a": NaN}', "reference"),
        (b'{"a": 1e5000}', "reference"),
        (b'{"a": "\\ud800"}', "reference"),  # orjson refuses it
        (b'{"a": "\\ud800", "b": 1.5}', "reference"),
        (b'{"a": "\\"\\ud800:", "b": 1}', "reference"),
    ],
)
def test_each_document_is_read_by_the_fastest_reader_that_reads_it_exactly(
    monkeypatch: pytest.MonkeyPatch, text: bytes | str, reader: str
) -> None:
    assert _reader(monkeypatch, text) == reader


@pytest.mark.parametrize("limit", [0, 5000])
def test_a_process_that_changed_the_integer_digit_limit_still_gets_the_reference_answer(limit: int) -> None:
    """The hooks leave integers to ``int``, whose digit limit a process may change; the limit here stays 4300."""
    texts = [b"[1" + b"0" * 4299 + b"]", b"[1" + b"0" * 4300 + b"]", b'{"a": 1.5, "b": -1' + b"0" * 4300 + b"}"]
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(limit)
    try:
        for text in texts:
            _assert_same(text)
    finally:
        sys.set_int_max_str_digits(before)


def test_each_document_counts_its_own_exponents(monkeypatch: pytest.MonkeyPatch) -> None:
    exactjson.loads(b"[" + b",".join([b"1e300"] * 221) + b"]")  # grows the text by 65,416 characters
    assert _reader(monkeypatch, b"[" + b",".join([b"1e+300"] * 10) + b"]") == "orjson"  # by 2,950 more: its own


def test_nesting_is_read_as_the_reference_reads_it_from_deep_in_a_stack() -> None:
    """Both refuse more than MAX_DEPTH levels, even where the reference's parser would stop sooner or later."""
    texts = [b"[" * 64 + b"1.5" + b"]" * 64, b"[" * 65 + b"1" + b"]" * 65, b"[" * 230 + b"1.5" + b"]" * 230]

    def read(text: bytes, loads: Any) -> Any:
        try:
            return ("value", loads(text))
        except JsonValueError as exc:
            return ("refused", exc.reason, exc.path, str(exc))

    def at_depth(frames: int) -> list[tuple[Any, Any]]:
        if frames:
            return at_depth(frames - 1)
        return [(read(text, exactjson.loads), read(text, exactjson.reference_loads)) for text in texts]

    outcomes = at_depth(sys.getrecursionlimit() - 200 - len(inspect.stack()))  # room for about 200 levels
    assert [reference[0] for _, reference in outcomes] == ["value", "refused", "refused"]
    for fast, reference in outcomes:  # compared back at a shallow depth
        assert (fast[0], _shape(fast[1]) if fast[0] == "value" else fast[1:]) == (
            reference[0],
            _shape(reference[1]) if reference[0] == "value" else reference[1:],
        )


@pytest.mark.parametrize("text", [b'{"a": "\\ud800"}', b'["x", {"\\udfff": 1}]', '["\ud800"]'])
def test_the_hooks_refuse_unpaired_surrogates_as_the_reference_does(text: bytes | str) -> None:
    """orjson refuses these before the hooks see them; the hooks must not depend on it."""
    with pytest.raises(JsonValueError) as plain:
        exactjson._read_plainly(text, False)
    with pytest.raises(JsonValueError) as reference:
        exactjson.reference_loads(text)
    assert (plain.value.reason, plain.value.path, str(plain.value)) == (
        reference.value.reason,
        reference.value.path,
        str(reference.value),
    )
