"""The provider's free text, kept from echoing the request: what it quotes of a request goes no further.

A provider's refusal often quotes the value it refused (``at input: 'the prompt...' is not of type 'object'``), and
that text becomes the operation's reason: a log line, the ``generation.transitions`` event, the live view. Prompts
stay in the ledger's ``request`` (docs/limits.md, "No payload in log lines"), so before such a text is kept, each
string value of the request that it holds, and each quoted part of it that is a piece of one, is replaced by
:data:`REDACTED`. Field names (the request's keys) and what the provider wrote of its own stay.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from streams.errors import JsonValueError
from streams.wire import exactjson

#: What replaces a piece of the request in the provider's text.
REDACTED = "<request text>"

#: Request values shorter than this are not looked for in the provider's text (``"m"``, ``"en"``: the provider's own
#: words hold them).
MIN_ECHO_CHARS = 4

#: A quoted part of the provider's text shorter than this is kept even when a request value holds it (``'object'``,
#: ``'string'``: the provider's words for types and fields, which a prompt may hold too).
MIN_QUOTED_CHARS = 8

#: The most of the provider's text looked at (characters; the reason keeps 500): the rest is dropped before
#: redacting, which is then bounded by this times the request's values.
MAX_TEXT_CHARS = 4000

#: What splits a quoted part into pieces: the marks of a shortened value.
_PIECE_SPLIT = re.compile(r"\.\.\.|\u2026")

#: A part of the provider's text in single, double or typographic quotes (at most 2,000 characters).
_QUOTED = re.compile(
    r"'([^']{1,2000})'|\"([^\"]{1,2000})\"|\u2018([^\u2019]{1,2000})\u2019|\u201c([^\u201d]{1,2000})\u201d"
)


def _string_values(node: Any) -> Iterator[str]:
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _written_forms(value: str) -> set[str]:
    """``value`` as a provider may write it back: as it is, escaped as in Python's ``repr`` (``\\n``, ``\\'``), and
    as in JSON (with and without ``\\u`` escapes)."""
    return {value, repr(value)[1:-1], json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}


def _spans_of(text: str, form: str) -> Iterator[tuple[int, int]]:
    start = text.find(form)
    while start != -1:
        yield start, start + len(form)
        start = text.find(form, start + 1)


def without_request_echoes(text: str, request_text: str) -> str:
    """``text``, cut to :data:`MAX_TEXT_CHARS`, with what it holds of the request ``request_text`` (JSON text)
    replaced by :data:`REDACTED`, all found in the cut text as it is and replaced at once (a marker is never searched):
    each written form (:func:`_written_forms`) of a value of :data:`MIN_ECHO_CHARS` or more; each quoted part whose
    pieces between ``...`` marks and those forms, of :data:`MIN_QUOTED_CHARS` or more, all occur in request values;
    and an end of the text that begins a value (the cut's, or the provider's). A request that is not JSON is taken as
    one string value."""
    try:
        request: Any = exactjson.loads(request_text)
    except JsonValueError:
        request = request_text
    forms = {f for v in _string_values(request) if len(v) >= MIN_ECHO_CHARS for f in _written_forms(v)}
    haystack = "\0".join(forms)  # one search per piece, not one per piece and value
    text = text[:MAX_TEXT_CHARS]
    covered = bytearray(len(text))  # 1 where the text holds a piece of the request

    def cover(start: int, end: int) -> None:
        covered[start:end] = b"\1" * (end - start)

    for form in forms:
        for start, end in _spans_of(text, form):
            cover(start, end)
    for match in _QUOTED.finditer(text):
        group = next(g for g in range(1, 5) if match.group(g) is not None)
        start, end = match.span(group)
        uncovered = "".join(c if not covered[start + k] else "\0" for k, c in enumerate(text[start:end]))
        pieces = [p for p in _PIECE_SPLIT.split(uncovered.replace("\0", "...")) if len(p) >= MIN_QUOTED_CHARS]
        if pieces and all(p in haystack for p in pieces):
            cover(start, end)
    for form in forms:  # the end of the text inside a value
        if len(form) < MIN_QUOTED_CHARS:
            continue
        for start, _ in _spans_of(text[max(0, len(text) - len(form)) :], form[:MIN_QUOTED_CHARS]):
            start += max(0, len(text) - len(form))
            if form.startswith(text[start:]):
                cover(start, len(text))
                break
    out: list[str] = []
    k = 0
    while k < len(text):
        if covered[k]:
            while k < len(text) and covered[k]:
                k += 1
            out.append(REDACTED)
        else:
            j = covered.find(b"\1", k)
            j = len(text) if j == -1 else j
            out.append(text[k:j])
            k = j
    return "".join(out)
