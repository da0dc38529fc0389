"""JSON Schema ``format`` keywords: every format the schemas may use is enforced, or the schema is refused."""

from __future__ import annotations

import copy
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
