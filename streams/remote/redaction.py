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

#: What splits a quoted part into pieces: the marks of a shortened value and the redaction marker.
_PIECE_SPLIT = re.compile(r"\.\.\.|\u2026|" + re.escape(REDACTED))

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


def _pieces(part: str) -> list[str]:
    """The pieces of a quoted part between the marks a provider shortens a value with (``...``, ``…``) and between
    pieces already redacted."""
    return [p for p in _PIECE_SPLIT.split(part) if p]


def without_request_echoes(text: str, request_text: str) -> str:
    """``text``, cut to :data:`MAX_TEXT_CHARS`, with what it holds of the request ``request_text`` (JSON text)
    replaced by :data:`REDACTED`: each written form (:func:`_written_forms`) of a value of :data:`MIN_ECHO_CHARS` or
    more, longest first; then each quoted part whose pieces (:func:`_pieces`) of :data:`MIN_QUOTED_CHARS` or more all
    occur in request values; and an end of the cut text that begins a value. A request that is not JSON is taken as one
    string value."""
    try:
        request: Any = exactjson.loads(request_text)
    except JsonValueError:
        request = request_text
    forms = sorted(
        {f for v in _string_values(request) if len(v) >= MIN_ECHO_CHARS for f in _written_forms(v)},
        key=len,
        reverse=True,
    )
    text = text[:MAX_TEXT_CHARS]
    haystack = "\0".join(forms)  # one search per piece, not one per piece and value

    def quoted(match: re.Match[str]) -> str:
        part = next(group for group in match.groups() if group is not None)
        pieces = [p for p in _pieces(part) if len(p) >= MIN_QUOTED_CHARS]
        if pieces and all("\0" not in p and p in haystack for p in pieces):
            return match.group(0).replace(part, REDACTED)
        return match.group(0)

    for form in forms:
        text = text.replace(form, REDACTED)
    text = _QUOTED.sub(quoted, text)
    for form in forms:  # a value the cut ends inside
        if len(form) < MIN_QUOTED_CHARS:
            break
        start = text.find(form[:MIN_QUOTED_CHARS], max(0, len(text) - len(form)))
        if start != -1 and form.startswith(text[start:]):
            text = text[:start] + REDACTED
    return text
