"""JSON in and out of the system without changing a number.

Every place JSON enters the system (Kafka values, the remote API's answers, jsonb read back from PostgreSQL,
``streams submit`` files) reads it with :func:`loads`; every place it leaves (Kafka values, POST bodies, jsonb
written to PostgreSQL, ``streams follow``) writes it with :func:`dumps`.

Why not ``orjson.loads`` alone: it turns integers outside ``[-2**63, 2**64 - 1]`` into binary doubles (``2**64``
and ``2**64 + 1`` both become ``18446744073709551616.0``) and reads every fraction as a double. :func:`loads` uses
it only where its value is exact (most documents), and gives the same value or error for every input as
:func:`reference_loads`. Here:

============================== ==================================================================
JSON number                    Python value
============================== ==================================================================
an integer, any size           ``int`` (exact)
a fraction or an exponent      :class:`JsonDecimal`, a :class:`decimal.Decimal` (exact value and digits:
                               ``1.50`` stays ``1.50``, ``1e400`` stays ``1E+400``)
============================== ==================================================================

:func:`dumps` writes both back as the same JSON numbers, so a payload the system does not interpret (an output,
a ``source``, the provider's request body) is carried exactly. PostgreSQL ``jsonb`` keeps such numbers exactly
too (``numeric``); it writes exponents out in plain digits (``1E+3`` is read back as ``1000``).

What cannot be carried exactly is refused with :class:`~streams.errors.JsonValueError`, naming the field:

* ``NaN``, ``Infinity``, ``-Infinity`` (not JSON: RFC 8259, section 6) -> ``not_json``;
* a number whose plain decimal form has more than :data:`MAX_NUMBER_DIGITS` digits (Python's own limit for
  integers, and beyond what PostgreSQL's ``numeric`` stores past the decimal point), or numbers in exponent form
  that would expand by more than :data:`MAX_EXPANSION_CHARS` characters in all once stored -> ``number_out_of_range``;
* text that is not UTF-8, not JSON, or a string with an unpaired surrogate -> ``not_json``;
* a document nested more than :data:`MAX_DEPTH` levels deep (the one depth limit of every document the system
  reads: submissions, the provider's answers, outputs, jsonb read back) -> ``too_deep``, path ``(root)``;
* on request (``unique_keys``, every Kafka value), a key repeated in one object -> ``not_json``.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any, TypeGuard

import orjson

from streams.errors import JsonValueError

#: Most digits of one number in plain decimal form (``sys.int_info.default_max_str_digits``).
MAX_NUMBER_DIGITS = 4300

#: Most characters that numbers written with an exponent may add to a document once stored in plain digits
#: (PostgreSQL ``jsonb`` writes ``1e4000`` as 4001 characters): a small answer cannot become a huge event.
MAX_EXPANSION_CHARS = 65_536

#: The integers ``orjson.dumps`` writes natively; wider ones are written from their decimal text.
_ORJSON_INT_MIN, _ORJSON_INT_MAX = -(2**63), 2**64 - 1

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

#: Most levels of nesting of a document (``[]`` is 1 level, ``{"a": [1]}`` 2): the one depth limit of every document
#: the system reads, checked by :func:`loads` where it enters. Far below what every walk over a value can take:
#: orjson writes at most 254 levels, the standard parser and recursive walks stop near Python's recursion limit
#: (1000 frames, less the caller's stack), so the envelopes the system puts around a document (a few levels) and
#: recursive walks of two frames per level (:func:`streams.wire.jsontext.canonical`) stay well within them.
MAX_DEPTH = 64

#: Most levels of nesting that ``orjson.dumps`` writes (its own limit).
_ORJSON_MAX_DEPTH = 254


class JsonDecimal(Decimal):
    """A JSON number with a fraction or an exponent, exactly as written; its ``repr`` is its JSON text, so error
    messages (jsonschema's among them) show ``1.5`` rather than ``Decimal('1.5')``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


class _Refused:
    """Stands in the parsed value for a token that cannot be carried exactly, so its path can be named."""

    __slots__ = ("reason", "why")

    def __init__(self, reason: str, why: str) -> None:
        self.reason = reason
        self.why = why


def _plain_digits(number: Decimal) -> int:
    """Characters of ``number`` written without an exponent (sign excluded)."""
    _, digits, exponent = number.as_tuple()
    assert isinstance(exponent, int)  # finite: the JSON grammar has no NaN or infinity
    if exponent >= 0:
        return len(digits) + exponent
    return max(len(digits), -exponent) + 1


def _path(parts: list[str | int]) -> str:
    return "/".join(str(p) for p in parts) or "(root)"


def _walk(value: Any) -> Iterator[tuple[list[str | int], Any]]:
    """Every value in document order with its path; iterative, so any depth the parser accepted is fine."""
    stack: list[tuple[list[str | int], Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        yield path, item
        if isinstance(item, dict):
            stack.extend(([*path, k], v) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(([*path, i], v) for i, v in reversed(list(enumerate(item))))


def loads(data: bytes | str, *, unique_keys: bool = False) -> Any:
    """Parse JSON text with every number exact (see the module docstring for the mapping).

    The same value, or the same :class:`~streams.errors.JsonValueError` (reason, path, message), as
    :func:`reference_loads` for every input, read by the fastest of three readers that reads it exactly:
    ``orjson.loads`` (:func:`_exact_value` says when its value is exact); for what orjson reads but not exactly,
    the standard parser with hooks built once (:func:`_read_plainly`: any number the reference would not
    refuse); else (orjson refuses it, or the hooks give up) :func:`reference_loads`.

    Args:
        data: UTF-8 bytes or a str.
        unique_keys: refuse (``not_json``, naming the field) a key that appears twice in one object: JSON
            parsers disagree on which one counts (RFC 8259, section 4), so such a value has no single meaning.

    Raises:
        JsonValueError: ``reason`` ``not_json``, ``number_out_of_range`` or ``too_deep`` (over :data:`MAX_DEPTH`
            levels), ``path`` the field (``a/0/b``, ``(root)``), the message what was wrong.
    """
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        # Not JSON, NaN, an unpaired surrogate, deeper than 1024 levels, or a number beyond a double (``1e400``):
        # all but the last are refused, and the reference says why.
        return reference_loads(data, unique_keys=unique_keys)
    value = _exact_value(data, value, unique_keys)
    if value is not _NOT_EXACT:
        return value
    try:
        return _read_plainly(data, unique_keys)
    except (ValueError, RecursionError, _GiveUp):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return reference_loads(data, unique_keys=unique_keys)


class _GiveUp(Exception):
    """A token that :func:`reference_loads` would refuse (a number, a constant, a repeated key): it names it."""


class _Expansion(threading.local):
    """Characters that the exponents of the document being read add once written out (one count per thread)."""

    chars = 0


_EXPANSION = _Expansion()


def _fraction(token: str) -> JsonDecimal:
    """A fraction or an exponent as :func:`reference_loads` reads it; :class:`_GiveUp` where it would refuse.

    Without an exponent the plain form is no longer than the text: within the digit limit when the text is, and
    it grows the text by nothing."""
    number = JsonDecimal(token)
    if len(token) > MAX_NUMBER_DIGITS or "e" in token or "E" in token:
        plain = _plain_digits(number)
        if plain > MAX_NUMBER_DIGITS:
            raise _GiveUp(token)
        if plain > len(token):
            _EXPANSION.chars += plain - len(token)
            if _EXPANSION.chars > MAX_EXPANSION_CHARS:
                raise _GiveUp(token)
    return number


def _give_up(token: str) -> Any:
    raise _GiveUp(token)


def _unique_or_give_up(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        raise _GiveUp("a repeated key")
    return value


#: The standard library's parser with hooks that need no state of their own: integers read by ``int`` itself
#: (which refuses more than ``sys.get_int_max_str_digits()`` digits, :data:`MAX_NUMBER_DIGITS` unless changed).
_PLAIN_DECODERS = {
    unique_keys: json.JSONDecoder(
        parse_float=_fraction,
        parse_constant=_give_up,
        object_pairs_hook=_unique_or_give_up if unique_keys else None,
    )
    for unique_keys in (False, True)
}


def _read_plainly(data: bytes | str, unique_keys: bool) -> Any:
    """:func:`reference_loads` for a document that it would not refuse for a number, a constant or a repeated
    key: the same parser with hooks built once, which give up where the reference would name a refused token.
    Raises ``ValueError`` (not JSON, not UTF-8, an integer over the digit limit),
    ``RecursionError`` or :class:`_GiveUp` for anything else: the caller asks :func:`reference_loads`, which
    names the reason."""
    if sys.get_int_max_str_digits() != MAX_NUMBER_DIGITS:
        raise _GiveUp("the process changed the integer digit limit")
    text = bytes(data).decode("utf-8") if isinstance(data, bytes | bytearray | memoryview) else data
    _EXPANSION.chars = 0
    value = _PLAIN_DECODERS[unique_keys].decode(text)
    if _may_hold_unpaired_surrogates(data, text):
        _refuse_unpaired_surrogates(value)
    return value


#: What :func:`_exact_value` returns for a value that orjson did not read exactly.
_NOT_EXACT: Any = object()


def _exact_value(data: bytes | str, value: Any, unique_keys: bool) -> Any:
    """``value``, what ``orjson.loads(data)`` returned, made what :func:`reference_loads` returns, or
    :data:`_NOT_EXACT`.

    What orjson does differently (seen in ``tests/unit/test_exactjson_fast.py``), and how each is caught here:

    * a number with a fraction or an exponent, and an integer outside ``[-2**63, 2**64 - 1]``, become a
      ``float``: a document with a float is read exactly only as :func:`_floats_as_written` says;
    * it reads up to 1024 levels of nesting, the reference as deep as Python's recursion limit lets it (less
      than 1000, fewer when called from deep in a stack): both refuse more than :data:`MAX_DEPTH` levels
      (:func:`_too_deep`), checked here;
    * a repeated key is read silently (the last value counts, in the place of the first, as the reference does
      without ``unique_keys``): with ``unique_keys``, the document must be shown to repeat none (below).

    Everything else orjson refuses that the reference refuses too (not UTF-8, a BOM, an unpaired surrogate,
    ``NaN``, a control character in a string, trailing data), and such a document goes to the reference, which
    names the reason. Repeated keys: every string of the value (a key or a string value) is one string token of
    the text, and a repeated key drops at least one token (itself); the text holds two ``"`` per token plus one
    per escaped quote, so ``count('"')`` equal to twice the value's strings proves that no key was repeated.
    When strings hold escaped quotes, the colons: every key is followed by one ``:`` and no other ``:`` stands
    outside a string, so as many ``:`` in all as the value has keys proves it too. Otherwise: the reference.
    """
    stack = [value]
    containers: list[Any] = []
    pairs = strings = 0
    floats = False
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            containers.append(item)
            pairs += len(item)
            strings += len(item)
            stack.extend(item.values())
        elif kind is list:
            containers.append(item)
            stack.extend(item)
        elif kind is str:
            strings += 1
        elif kind is float:
            floats = True
    if len(containers) > MAX_DEPTH and depth(value) > MAX_DEPTH:
        raise _too_deep()
    if floats:
        return _floats_as_written(data, value, containers)
    if not unique_keys or pairs == 0:
        return value
    text = data.encode() if isinstance(data, str) else bytes(data)  # orjson read it: it is UTF-8
    if text.count(b'"') == 2 * strings or text.count(b":") == pairs:
        return value
    return _NOT_EXACT


def _floats_as_written(data: bytes | str, value: Any, containers: list[Any]) -> Any:
    """``value`` (with ``containers``, its dicts and lists) with each float replaced by the :class:`JsonDecimal`
    of its token, when ``data`` is exactly what ``orjson.dumps(value)`` writes (compact text from orjson: the
    simulator's answers, our own Kafka values): then each float's token is ``orjson.dumps(that_float)``, no key
    was repeated (its pair would be missing) and each integer is exact (an integer orjson read as a float would
    be written differently). :data:`_NOT_EXACT` otherwise, or for a token the reference would refuse. Changes
    ``value`` in place."""
    text = data.encode() if isinstance(data, str) else bytes(data)  # orjson read it: it is UTF-8
    if orjson.dumps(value) != text:
        return _NOT_EXACT
    _EXPANSION.chars = 0
    if not containers:
        return _fraction_or_not_exact(text.decode())
    for item in containers:
        if type(item) is dict:
            if float in map(type, item.values()):
                for key, child in item.items():
                    if type(child) is float:
                        item[key] = number = _fraction_or_not_exact(orjson.dumps(child).decode())
                        if number is _NOT_EXACT:
                            return _NOT_EXACT
        elif float in map(type, item):
            for index, child in enumerate(item):
                if type(child) is float:
                    item[index] = number = _fraction_or_not_exact(orjson.dumps(child).decode())
                    if number is _NOT_EXACT:
                        return _NOT_EXACT
    return value


def _fraction_or_not_exact(token: str) -> Any:
    try:
        return _fraction(token)
    except _GiveUp:
        return _NOT_EXACT


def _too_deep() -> JsonValueError:
    """The refusal of a document nested more than :data:`MAX_DEPTH` levels (no field named: the path to it could
    be as long as the document)."""
    why = f"nested more than {MAX_DEPTH} levels deep (at most {MAX_DEPTH} are read)"
    return JsonValueError("too_deep", why, path="(root)")


def check_depth(value: Any) -> None:
    """Refuse a value (built in Python, not read by :func:`loads`) nested more than :data:`MAX_DEPTH` levels.

    Raises:
        JsonValueError: reason ``too_deep``.
    """
    if depth(value) > MAX_DEPTH:
        raise _too_deep()


def depth(value: Any) -> int:
    """Levels of nesting of ``value`` (a scalar: 0, ``[]``: 1, ``[[]]``: 2); iterative, so any depth."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            level += 1
            deepest = max(deepest, level)
            stack.extend((v, level) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def reference_loads(data: bytes | str, *, unique_keys: bool = False) -> Any:
    """:func:`loads` on the standard library's parser with hooks: every document, slower; the reference that
    :func:`loads` agrees with (arguments, value and errors the same)."""
    if isinstance(data, bytes | bytearray | memoryview):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonValueError("not_json", f"not JSON: not UTF-8 ({exc})") from exc
    else:
        text = data
    refused = 0
    expansion = 0

    def refuse(reason: str, why: str) -> _Refused:
        nonlocal refused
        refused += 1
        return _Refused(reason, why)

    def parse_int(token: str) -> int | _Refused:
        digits = len(token.lstrip("-"))
        if digits > MAX_NUMBER_DIGITS:
            why = f"an integer of {digits} digits (at most {MAX_NUMBER_DIGITS} are carried exactly)"
            return refuse("number_out_of_range", why)
        return int(token)

    def parse_float(token: str) -> JsonDecimal | _Refused:
        nonlocal expansion
        number = JsonDecimal(token)
        plain = _plain_digits(number)
        if plain > MAX_NUMBER_DIGITS:
            why = f"{token[:40]} has {plain} digits written out (at most {MAX_NUMBER_DIGITS} are carried exactly)"
            return refuse("number_out_of_range", why)
        expansion += max(0, plain - len(token))
        if expansion > MAX_EXPANSION_CHARS:
            why = f"{token[:40]}: numbers with exponents grow the text by over {MAX_EXPANSION_CHARS} characters"
            return refuse("number_out_of_range", why)
        return number

    def parse_constant(token: str) -> _Refused:
        return refuse("not_json", f"{token} is not a JSON number (RFC 8259, section 6)")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        value: dict[str, Any] = {}
        for key, item in pairs:
            if key in value:
                item = refuse("not_json", f"key {key!r} appears twice in one object (RFC 8259, section 4)")
            value[key] = item
        return value

    def decode(object_pairs_hook: Callable[[list[tuple[str, Any]]], dict[str, Any]] | None) -> Any:
        decoder = json.JSONDecoder(
            parse_int=parse_int,
            parse_float=parse_float,
            parse_constant=parse_constant,
            object_pairs_hook=object_pairs_hook,
        )
        try:
            return decoder.decode(text)
        except json.JSONDecodeError as exc:
            raise JsonValueError("not_json", f"not JSON: {exc}") from exc
        except RecursionError as exc:
            raise _too_deep() from exc

    value = decode(unique if unique_keys else None)
    if depth(value) > MAX_DEPTH:
        raise _too_deep()
    if refused:
        found = _first_refused(value)
        if found is None:  # in a value that a repeated key replaced: read again keeping it, to name its field
            expansion = 0
            found = _first_refused(decode(_keep_refused))
        assert found is not None
        path, bad = found
        raise JsonValueError(bad.reason, f"at {_path(path)}: {bad.why}", path=_path(path))
    if _may_hold_unpaired_surrogates(data, text):
        _refuse_unpaired_surrogates(value)
    return value


def _first_refused(value: Any) -> tuple[list[str | int], _Refused] | None:
    return next(((p, v) for p, v in _walk(value) if isinstance(v, _Refused)), None)


def _keep_refused(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object in which a repeated key keeps an earlier value that holds a refused token (else the last)."""
    value: dict[str, Any] = {}
    for key, item in pairs:
        if key not in value or _first_refused(value[key]) is None:
            value[key] = item
    return value


def _may_hold_unpaired_surrogates(data: bytes | str, text: str) -> bool:
    """False when no string parsed from ``text`` can hold an unpaired surrogate: no ``\\ud800``-``\\udfff``
    escape, and ``data`` was bytes (valid UTF-8) or a str that UTF-8 can hold."""
    if _SURROGATE_ESCAPE.search(text):
        return True
    if isinstance(data, str) and not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return True
    return False


def _refuse_unpaired_surrogates(value: Any) -> None:
    """Refuse strings that no UTF-8 text can hold (``"\\ud800"`` alone), as orjson and PostgreSQL would."""
    for path, item in _walk(value):
        texts = [item] if isinstance(item, str) else list(item) if isinstance(item, dict) else []
        for s in texts:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = _path(path)
                why = f"at {where}: a string with an unpaired surrogate (not UTF-8 text)"
                raise JsonValueError("not_json", why, path=where) from exc


def _default(value: Any) -> Any:
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise TypeError(f"{value} cannot be written as a JSON number (RFC 8259, section 6)")
        return orjson.Fragment(str(value))
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _wide_ints_as_text(value: Any) -> Any:
    """A copy of ``value`` in which integers orjson cannot write are pre-written JSON fragments."""
    if isinstance(value, dict):
        return {k: _wide_ints_as_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_wide_ints_as_text(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not _ORJSON_INT_MIN <= value <= _ORJSON_INT_MAX:
        return orjson.Fragment(str(value))
    return value


def dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON, every ``int`` and :class:`~decimal.Decimal` written exactly.

    Raises:
        TypeError: a value JSON cannot hold (an unsupported type, a non-finite Decimal, an unpaired surrogate,
            nesting deeper than orjson writes: 254 levels, far over :data:`MAX_DEPTH`).
    """
    try:
        return orjson.dumps(value, default=_default)
    except orjson.JSONEncodeError:
        pass  # most often an integer beyond 64 bits: write those from their text, or raise the real error
    deepest = depth(value)  # iterative: the copy below recurses, within the depth checked here
    if deepest > _ORJSON_MAX_DEPTH:
        raise TypeError(f"a value nested {deepest} levels deep cannot be written (at most {_ORJSON_MAX_DEPTH})")
    return orjson.dumps(_wide_ints_as_text(value), default=_default)


def is_number(value: Any) -> TypeGuard[int | float | Decimal]:
    """True for a JSON number as :func:`loads` returns it (``int`` or ``Decimal``; also ``float``), not a bool."""
    return isinstance(value, int | float | Decimal) and not isinstance(value, bool)
