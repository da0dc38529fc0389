"""JSON Schema ``format`` keywords: every format the schemas may use is enforced, or the schema is refused."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import orjson
import pytest

from streams.errors import ConfigError, InvalidEventError
from streams.wire import contracts
from tests.unit.test_contracts import LIMIT, VALID_POLL, VALID_SUBMISSION

# Every format of JSON Schema 2020-12 -> (a value that breaks it, a value that satisfies it).
FORMAT_FIXTURES: dict[str, tuple[str, str]] = {
    "date-time": ("2024-05-01T10:00:00", "2024-05-01T10:00:00Z"),  # no offset: not RFC 3339
    "date": ("2024-02-30", "2024-02-29"),
    "time": ("25:00:00Z", "10:00:00+02:00"),
    "duration": ("P1Y2", "P1Y2M"),
    "email": ("no-at-sign", "a@example.org"),
    "idn-email": ("no-at-sign", "a@example.org"),
    "hostname": ("-bad-.example", "api.example.org"),
    "idn-hostname": ("-bad-.example", "api.example.org"),
    "ipv4": ("256.1.1.1", "127.0.0.1"),
    "ipv6": ("1::2::3", "::1"),
    "uri": ("not a uri", "https://example.org/x"),
    "uri-reference": ("http://[bad", "/relative/path"),
    "iri": ("not an iri", "https://例え.jp/x"),
    "iri-reference": ("http://[bad", "/相対"),
    "uuid": ("123", "123e4567-e89b-12d3-a456-426614174000"),
    "uri-template": ("{unclosed", "/v1/{id}"),
    "json-pointer": ("no-leading-slash", "/a/0"),
    "relative-json-pointer": ("/a", "0/a"),
    "regex": ("(unclosed", "^a+$"),
}


def format_schema(fmt: str) -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"field": {"type": "string", "format": fmt}},
    }


@pytest.mark.parametrize("fmt", sorted(FORMAT_FIXTURES))
def test_every_format_is_enforced(fmt: str) -> None:
    """jsonschema enforces a format only with a FormatChecker and, for most, an extra package (date-time:
    rfc3339-validator): without them all of these bad values passed."""
    bad, good = FORMAT_FIXTURES[fmt]
    v = contracts.compile_schema(format_schema(fmt), f"{fmt}.json")
    errors = list(v.iter_errors({"field": bad}))
    assert [(list(e.absolute_path), e.validator) for e in errors] == [(["field"], "format")]
    assert f"is not a '{fmt}'" in errors[0].message
    assert list(v.iter_errors({"field": good})) == []


def test_a_format_that_cannot_be_enforced_is_refused_when_the_schema_loads() -> None:
    with pytest.raises(ConfigError, match=r"uses format 'date_time' at properties/field, which is not enforced"):
        contracts.compile_schema(format_schema("date_time"), "typo.json")


def topic_formats() -> list[tuple[str, str, str]]:
    found = []
    for topic, name in sorted(contracts.SCHEMA_FILES.items()):
        schema = orjson.loads(contracts.schema_dir().joinpath(name).read_bytes())
        found += [(topic, where, fmt) for where, fmt in contracts.formats_used(schema)]
    return found


def test_formats_used_finds_keywords_not_property_names() -> None:
    schema = {"properties": {"format": {"type": "string", "format": "uuid"}, "b": {"enum": [{"format": "x"}]}}}
    assert list(contracts.formats_used(schema)) == [("properties/format", "uuid")]


@pytest.mark.parametrize(("topic", "where", "fmt"), topic_formats())
def test_each_format_of_each_topic_schema_rejects_its_negative_fixture(topic: str, where: str, fmt: str) -> None:
    """One negative fixture per format keyword per topic schema (none of the schemas uses a format today: this
    grows with them). The bad value is set at the keyword's property and must be refused naming that field."""
    valid = {"generation.submissions": VALID_SUBMISSION, "generation.polls": VALID_POLL}
    assert topic in valid, f"add a valid {topic} value to this test to check its format {fmt} at {where}"
    doc = copy.deepcopy(valid[topic])
    path = [p for p in where.split("/") if p != "properties"]
    target = doc
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = FORMAT_FIXTURES[fmt][0]
    with pytest.raises(InvalidEventError) as info:
        contracts.decode(topic, orjson.dumps(doc), LIMIT)
    err = info.value
    assert err.reason == "schema"
    assert f"at {'/'.join(path)}: " in str(err) and f"is not a '{fmt}'" in str(err)


# RFC 3987: ucschar anywhere, iprivate (U+E000) in the query only; what no IRI holds stays refused.
IRI_CASES: list[tuple[str, str, bool]] = [
    ("iri", "https://例え.jp/パス?q=値#frag", True),
    ("iri", "https://example.org/a?x=\ue000", True),  # iprivate in the query
    ("iri", "https://example.org/\ue000", False),  # iprivate in the path
    ("iri", "https://example.org/a#\ue000", False),  # iprivate in the fragment
    ("iri", "https://example.org/a#?x=\ue000", False),  # a "?" in the fragment starts no query
    ("iri", "https://example.org/\ufffe", False),  # a noncharacter: no ucschar
    ("iri", "https://example.org/\x85", False),  # a C1 control: no ucschar
    ("iri", "https://example.org/a b", False),  # a space: no IRI, no URI
    ("iri", "/relative", False),  # no scheme
    ("iri", "mailto:名前@例え.jp", True),
    ("iri", "https://example.org/\U0001f600", True),  # plane 1
    ("iri", "https://example.org/\U000efffd", True),  # the last ucschar
    ("iri-reference", "相対/パス?値", True),
    ("iri-reference", "", True),
    ("iri-reference", "#\ue000", False),
    ("iri-reference", "\ud800", False),  # a lone surrogate
    ("iri", "http://a/?q#\ue000", False),  # the query ends at the "#"
    ("iri", "a:b/c\ue000?x", False),  # the first "?" starts the query
    ("iri", "a:b?\ue000?x", True),
    ("iri", "https://example.org/\U0001fffe", False),  # each plane ends at xFFFD
    ("iri", "https://example.org/\U000d0000", True),  # plane D
    ("iri", "https://example.org/\ufdd0", False),  # FDD0-FDEF are no ucschar
    ("iri", "https://example.org/a?\U000f0000", True),  # iprivate, plane 15
    ("iri", "https://example.org/a?\U0010fffd", True),  # iprivate, plane 16
    ("iri", "https://example.org/\U000e0001", False),  # the last ucschar range starts at E1000
    ("iri", "https://example.org/\n", False),  # a final newline ("$" matches before it)
    ("iri-reference", "\n", False),
    ("iri", "http://a?\ue000\n", False),
]


@pytest.mark.parametrize(("fmt", "value", "conforms"), IRI_CASES)
def test_iri_formats_follow_rfc_3987(fmt: str, value: str, conforms: bool) -> None:
    """Checked through the IRI's URI mapping (streams/wire/iri.py), not by rfc3987-syntax, which jsonschema imports at
    start whenever it is installed (0.7-1.0 s of every command that reads a schema)."""
    assert contracts.format_conforms(value, fmt) is conforms


def test_reading_the_schemas_leaves_rfc3987_syntax_out() -> None:
    """jsonschema imports rfc3987-syntax whenever it is installed, and it builds its parsers at import: a dependency
    that brings it back (jsonschema's format-nongpl extra does) slows every command that reads a schema."""
    code = "import sys, streams.wire.contracts; print('rfc3987_syntax' in sys.modules, 'lark' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_iri_formats_take_any_value_that_is_not_a_string() -> None:
    """As every format: a number or an object is for the schema's ``type`` to refuse."""
    assert contracts.format_conforms(5, "iri") and contracts.format_conforms(None, "iri-reference")


@pytest.mark.parametrize("fmt", [*contracts.NO_FINAL_NEWLINE_FORMATS, "iri", "iri-reference"])
def test_a_final_newline_breaks_a_format_that_holds_no_line_break(fmt: str) -> None:
    """jsonschema's checks of these match a pattern up to ``$``, which also matches before a final newline: it took
    ``"https://example.org/\\n"`` for a ``uri``. Checked through a compiled schema, as events are."""
    good = FORMAT_FIXTURES[fmt][1]
    v = contracts.compile_schema(format_schema(fmt), f"{fmt}.json")
    assert list(v.iter_errors({"field": good})) == []
    assert [e.validator for e in v.iter_errors({"field": good + "\n"})] == ["format"]
