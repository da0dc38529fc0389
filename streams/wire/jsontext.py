"""JSON text carried as it is: the verbatim text of an object's members, members appended without re-encoding,
and a canonical form to compare two values by meaning.

The provider's request travels from the Kafka event to the POST body as JSON *text*, never re-encoded: a big
integer (``2**64 + 1``), a number beyond double range or precision (``1e400``,
``0.1000000000000000055511151231257827``), an escaped or non-ASCII string reach the provider exactly as the
application wrote them. The product only appends members it owns (:func:`append_members`) to an object's text.

Every function here takes text that :func:`streams.wire.exactjson.loads` accepted (with ``unique_keys``: every Kafka
value is read so), so the walk over the text never meets a syntax error it has to explain.
"""

from __future__ import annotations

import decimal
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from streams.errors import InvalidEventError

_WHITESPACE = re.compile(r"[ \t\n\r]*")

#: Finds where a value ends; the numbers it reads are thrown away (kept as text, so none can fail to parse).
_DECODER = json.JSONDecoder(parse_int=str, parse_float=str)


@dataclass(frozen=True)
class Member:
    """One member of a JSON object's text: ``text[start:end]`` is its value, verbatim."""

    key: str
    start: int
    end: int


def _skip_whitespace(text: str, index: int) -> int:
    match = _WHITESPACE.match(text, index)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def members(text: str) -> list[Member]:
    """The members of the JSON object ``text`` in their order, each with the span of its verbatim value.

    ``text`` must be JSON that :func:`streams.wire.exactjson.loads` accepted, an object at the top (blanks around it
    are fine).

    Raises:
        InvalidEventError: reason ``not_json`` when ``text`` is not a JSON object.
    """
    index = _skip_whitespace(text, 0)
    if text[index : index + 1] != "{":
        raise InvalidEventError("not_json", "expected a JSON object")
    index = _skip_whitespace(text, index + 1)
    found: list[Member] = []
    if text[index : index + 1] == "}":
        return found
    try:
        while True:
            key, index = _DECODER.raw_decode(text, index)
            index = _skip_whitespace(text, index)
            if text[index : index + 1] != ":":
                raise ValueError(f"expected ':' at character {index}")
            start = _skip_whitespace(text, index + 1)
            _, end = _DECODER.raw_decode(text, start)
            found.append(Member(key, start, end))
            index = _skip_whitespace(text, end)
            if text[index : index + 1] == "}":
                return found
            if text[index : index + 1] != ",":
                raise ValueError(f"expected ',' or '}}' at character {index}")
            index = _skip_whitespace(text, index + 1)
    except (ValueError, RecursionError) as exc:
        raise InvalidEventError("not_json", f"expected a JSON object: {exc}") from exc


def member_texts(text: str) -> dict[str, str]:
    """``{key: verbatim value text}`` of the JSON object ``text`` (see :func:`members`)."""
    return {m.key: text[m.start : m.end] for m in members(text)}


def append_members(text: str, added: Iterable[tuple[str, str]], *, empty: bool | None = None) -> str:
    """The JSON object ``text`` with members ``(key, value JSON text)`` added before its closing brace.

    Every other character of ``text`` is kept as it is. ``empty`` says whether the object has no member yet
    (computed from ``text`` when None). The caller makes sure no added key is already there.
    """
    addition = ",".join(f"{json.dumps(key)}:{value}" for key, value in added)
    if not addition:
        return text
    if empty is None:
        empty = not members(text)
    close = len(text.rstrip(" \t\n\r")) - 1
    if text[close : close + 1] != "}":
        raise InvalidEventError("not_json", "expected a JSON object")
    return text[:close] + ("" if empty else ",") + addition + text[close:]


def _canonical_number(value: int | decimal.Decimal) -> str:
    """The exact value as ``<sign><digits>e<exponent>`` with no trailing zero in the digits (``0`` for zero), so
    ``5``, ``5.0`` and ``0.5e1`` agree. No decimal context is involved: nothing rounds, nothing overflows."""
    if isinstance(value, int):
        negative, digits, exponent = value < 0, str(abs(value)), 0
    else:
        sign, digit_tuple, exp = value.as_tuple()
        assert isinstance(exp, int)  # JSON has no NaN or infinity, and exactjson.loads refuses them
        negative, digits, exponent = bool(sign), "".join(map(str, digit_tuple)).lstrip("0"), exp
    stripped = digits.rstrip("0")
    if not stripped:
        return "0"
    return f"{'-' if negative else ''}{stripped}e{exponent + len(digits) - len(stripped)}"


def canonical(value: Any) -> str:
    """A canonical JSON-like text of a value from :func:`streams.wire.exactjson.loads`: two values have the same text
    exactly when they mean the same JSON (keys sorted, numbers compared by exact value, strings by their
    characters whatever their escapes; ``true`` is not ``1``).

    Recursive, two frames per level: within Python's recursion limit for every value that
    :func:`streams.wire.exactjson.loads` returns (at most :data:`streams.wire.exactjson.MAX_DEPTH` levels)."""
    if isinstance(value, dict):
        items = sorted(value.items())
        return "{" + ",".join(f"{json.dumps(k)}:{canonical(v)}" for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    if value is True or value is False or value is None:
        return json.dumps(value)
    if isinstance(value, int | decimal.Decimal):
        return _canonical_number(value)
    raise TypeError(f"{type(value).__name__} is not a value exactjson.loads returns")
