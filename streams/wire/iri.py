"""The JSON Schema formats ``iri`` and ``iri-reference``, checked through their URI mapping.

An IRI (RFC 3987) is a URI (RFC 3986) that may also hold the characters of ``ucschar`` anywhere and those of
``iprivate`` in its query (RFC 3987, section 2.2). Mapped to a URI by percent-encoding those characters' UTF-8 bytes
(RFC 3987, section 3.1), a string is an IRI exactly when the mapping is a URI: any other character outside ASCII
stays as it is, and the URI check refuses it. The URI check is ``rfc3986-validator``'s grammar, which jsonschema uses
for ``uri`` and ``uri-reference``, matched in full (its own function matches up to ``$``, which lets a final newline
through); like that grammar it takes an IPv4 part of an IPv6 literal with leading zeros (``[::ffff:001.2.3.4]``),
which RFC 3986's ``dec-octet`` does not.

jsonschema checks these two formats with ``rfc3987-syntax``, which it imports whenever it is installed and which
builds its parsers at import: 0.7-1.0 s of every command that reads a schema, the worker's start included. The
project does not install it; :mod:`streams.wire.contracts` registers these checks instead.
"""

from __future__ import annotations

from rfc3986_validator import URI_RE_COMP, URI_REF_RE_COMP

#: RFC 3987 ``ucschar``: allowed anywhere in an IRI (inclusive code point ranges).
UCSCHAR_RANGES = (
    (0xA0, 0xD7FF),
    (0xF900, 0xFDCF),
    (0xFDF0, 0xFFEF),
    *((plane + 0x0000, plane + 0xFFFD) for plane in range(0x10000, 0xE0000, 0x10000)),
    (0xE1000, 0xEFFFD),
)

#: RFC 3987 ``iprivate``: allowed in an IRI's query only.
IPRIVATE_RANGES = ((0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))


def _within(code: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return any(low <= code <= high for low, high in ranges)


def iri_to_uri(iri: str) -> str:
    """The URI an IRI maps to (RFC 3987, section 3.1): each ``ucschar``, and each ``iprivate`` of the query (after
    the first ``?``, before the first ``#`` that follows it), percent-encoded as UTF-8; every other character kept,
    so a string that is no IRI maps to a string that is no URI."""
    query_start = iri.find("?")
    fragment = iri.find("#")
    if fragment != -1 and query_start > fragment:
        query_start = -1  # a "?" in the fragment starts no query
    query_end = fragment if fragment > query_start else len(iri)
    parts: list[str] = []
    for index, char in enumerate(iri):
        code = ord(char)
        if code < 0x80:
            parts.append(char)
            continue
        in_query = query_start != -1 and query_start < index < query_end
        if _within(code, UCSCHAR_RANGES) or (in_query and _within(code, IPRIVATE_RANGES)):
            parts.append("".join(f"%{byte:02X}" for byte in char.encode("utf-8")))
        else:
            parts.append(char)
    return "".join(parts)


def is_iri(value: object) -> bool:
    """JSON Schema format ``iri``: an absolute IRI (scheme required); a value that is not a string conforms (as for
    every format)."""
    if not isinstance(value, str):
        return True
    return URI_RE_COMP.fullmatch(iri_to_uri(value)) is not None


def is_iri_reference(value: object) -> bool:
    """JSON Schema format ``iri-reference``: an IRI or a relative reference; a value that is not a string
    conforms."""
    if not isinstance(value, str):
        return True
    return URI_REF_RE_COMP.fullmatch(iri_to_uri(value)) is not None
