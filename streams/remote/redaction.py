"""The provider's free text, kept from echoing the request: what it quotes of a request goes no further.

A provider's refusal often quotes the value it refused (``at input: 'the prompt...' is not of type 'object'``), and
that text becomes the operation's reason: a log line, the ``generation.transitions`` event, the live view. Prompts
stay in the ledger's ``request`` (docs/limits.md, "No payload in log lines"), so before such a text is kept, each
string value of the request that it holds, and each quoted part of it that is a piece of one, is replaced by
:data:`REDACTED`. Field names (the request's keys) and what the provider wrote of its own stay.
"""

from __future__ import annotations

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


def without_request_echoes(text: str, request_text: str) -> str:
    """``text`` with every string value of the request ``request_text`` (JSON text) of :data:`MIN_ECHO_CHARS` or more
    that it holds, longest first, and every quoted part of :data:`MIN_QUOTED_CHARS` or more that is a piece of one,
    replaced by :data:`REDACTED`. A request that is not JSON is taken as one string value."""
    try:
        request: Any = exactjson.loads(request_text)
    except JsonValueError:
        request = request_text
    values = sorted({v for v in _string_values(request) if len(v) >= MIN_ECHO_CHARS}, key=len, reverse=True)
    for value in values:
        text = text.replace(value, REDACTED)

    def quoted(match: re.Match[str]) -> str:
        part = next(group for group in match.groups() if group is not None)
        if len(part) >= MIN_QUOTED_CHARS and REDACTED not in part and any(part in value for value in values):
            return match.group(0).replace(part, REDACTED)
        return match.group(0)

    return _QUOTED.sub(quoted, text)
