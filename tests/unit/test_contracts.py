"""JSON Schema contracts of every topic and the dead-letter envelope."""

from __future__ import annotations

import base64
import copy
import datetime as dt
from decimal import Decimal
from typing import Any

import jsonschema
import orjson
import pytest

from streams.errors import ConfigError, InvalidEventError
from streams.model.answers import OPERATION_ID
from streams.model.states import OperationState
from streams.wire import contracts, exactjson
from streams.wire.exactjson import MAX_DEPTH

SUB = "generation.submissions"
POLLS = "generation.polls"
DLQ = "generation.dead-letter"
LIMIT = 65_536

VALID_SUBMISSION: dict[str, Any] = {
    "operation_id": "conv-000001",
    "request": {"model": "genace-1", "input": {"prompt": "Write a haiku about leases", "max_tokens": 32}},
    "submitted_at_ms": 1_700_000_000_000,
    "source": {"trace": "conv", "row": 0},
}

VALID_POLL: dict[str, Any] = {
    "operation_id": "conv-000001",
    "remote_job_id": "job-1",
    "poll_claim_id": 1,
    "claimed_at_ms": 0,
}


def raw(value: Any) -> bytes:
    return orjson.dumps(value)


def decode_error(topic: str, data: bytes | None, limit: int = LIMIT) -> InvalidEventError:
    with pytest.raises(InvalidEventError) as info:
        contracts.decode(topic, data, limit)
    return info.value


# --- schema files ----------------------------------------------------------------------------------------------


def test_every_schema_file_is_registered() -> None:
    on_disk = sorted(p.name for p in contracts.schema_dir().iterdir() if p.name.endswith(".json"))
    assert on_disk == sorted(contracts.SCHEMA_FILES.values())
    assert sorted(contracts.SCHEMA_FILES) == [
        "generation.cancellations",
        "generation.dead-letter",
        "generation.outputs.delivered",
        "generation.polls",
        "generation.submissions",
        "generation.transitions",
    ]


@pytest.mark.parametrize("name", sorted(contracts.SCHEMA_FILES.values()))
def test_schema_file_is_valid_draft_2020_12(name: str) -> None:
    schema = orjson.loads(contracts.schema_dir().joinpath(name).read_bytes())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert jsonschema.validators.validator_for(schema) is jsonschema.Draft202012Validator
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize("topic", sorted(contracts.SCHEMA_FILES))
def test_validator_compiles(topic: str) -> None:
    v = contracts.validator(topic)
    assert v.META_SCHEMA == jsonschema.Draft202012Validator.META_SCHEMA
    assert v.format_checker is contracts.FORMAT_CHECKER


def test_unknown_topic_is_config_error() -> None:
    with pytest.raises(ConfigError, match=r"no JSON Schema registered for topic 'generation\.nope'"):
        contracts.validator("generation.nope")


def test_transition_schema_lists_every_operation_state() -> None:
    schema = orjson.loads(contracts.schema_dir().joinpath("generation.transitions.json").read_bytes())
    states = {s.value for s in OperationState}
    assert set(schema["properties"]["to_state"]["enum"]) == states
    assert set(schema["properties"]["from_state"]["enum"]) == states | {None}


# --- decode: submissions ---------------------------------------------------------------------------------------


def test_valid_submission_passes() -> None:
    assert contracts.decode(SUB, raw(VALID_SUBMISSION), LIMIT) == VALID_SUBMISSION


def test_minimal_submission_passes() -> None:
    value = {"operation_id": "a", "request": {}, "submitted_at_ms": 0}
    assert contracts.decode(SUB, raw(value), LIMIT) == value


@pytest.mark.parametrize("data", [b"{not json", b"\xff\xfe\x00", b"", b'{"a": 1'])
def test_not_json(data: bytes) -> None:
    err = decode_error(SUB, data)
    assert err.reason == "not_json"
    assert "not JSON" in str(err)


def test_none_is_not_json() -> None:
    err = decode_error(SUB, None)
    assert err.reason == "not_json"
    assert "tombstone" in str(err)


def test_oversized() -> None:
    data = raw(VALID_SUBMISSION)
    err = decode_error(SUB, data, limit=len(data) - 1)
    assert err.reason == "oversized"
    assert str(err) == f"value is {len(data)} bytes, over the {len(data) - 1}-byte limit"


def test_exactly_at_the_limit_passes() -> None:
    data = raw(VALID_SUBMISSION)
    assert contracts.decode(SUB, data, len(data)) == VALID_SUBMISSION


def test_oversized_checked_before_parsing() -> None:
    assert decode_error(SUB, b"x" * 11, limit=10).reason == "oversized"


def mutated(path: list[str], value: Any = None, *, delete: bool = False) -> dict[str, Any]:
    doc = copy.deepcopy(VALID_SUBMISSION)
    target = doc
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    ("doc", "where", "fragment"),
    [
        (mutated(["submitted_at_ms"], delete=True), "(root)", "'submitted_at_ms' is a required property"),
        (mutated(["operation_id"], delete=True), "(root)", "'operation_id' is a required property"),
        (mutated(["request"], delete=True), "(root)", "'request' is a required property"),
        (mutated(["request"], [1]), "request", "an array of 1 item is not of type 'object'"),
        (mutated(["request", "model"], ""), "request/model", "should be non-empty"),
        (mutated(["request", "model"], 7), "request/model", "7 is not of type 'string'"),
        (mutated(["request", "metadata"], "x"), "request/metadata", "a string of 1 character is not of type 'object'"),
        (
            mutated(["request", "metadata"], {"client_reference": "mine"}),
            "request/metadata/client_reference",
            "a request may not carry metadata.client_reference: the product sends the operation id as the "
            "provider's client reference",
        ),
        (mutated(["submitted_at_ms"], 2**63), "submitted_at_ms", "is greater than the maximum"),
        (mutated(["submitted_at_ms"], -1), "submitted_at_ms", "-1 is less than the minimum of 0"),
        (mutated(["extra"], 1), "(root)", "'extra' was unexpected"),
        (mutated(["operation_id"], "-starts-with-dash"), "operation_id", "'-starts-with-dash' does not match"),
        (mutated(["operation_id"], "has space"), "operation_id", "'has space' does not match"),
        (mutated(["operation_id"], "x" * 129), "operation_id", "does not match"),
        (mutated(["operation_id"], 42), "operation_id", "42 is not of type 'string'"),
        (mutated(["source", "nested"], {"a": 1}), "source/nested", "an object of 1 member is not of type"),
        (mutated(["source", "n"], {"prompt": "MARK" * 25_000}), "source/n", "an object of 1 member is not of type"),
        (
            mutated(["request", "metadata"], "MARK" * 25_000),
            "request/metadata",
            "a string of 100000 characters is not of type 'object'",
        ),
        (mutated(["operation_id"], "MARK" * 25_000), "operation_id", "a string of 100000 characters does not match"),
    ],
)
def test_schema_errors_name_the_field(doc: dict[str, Any], where: str, fragment: str) -> None:
    err = decode_error(SUB, raw(doc), limit=1_000_000)
    assert err.reason == "schema"
    message = str(err)
    assert message.startswith(f"{SUB} schema: at {where}: ")
    assert fragment in message
    assert "MARK" not in message and len(message) <= len(f"{SUB} schema: at {where}: ") + 300


def test_operation_id_pattern_accepts_its_alphabet() -> None:
    doc = mutated(["operation_id"], "A9._:-" + "x" * 122)  # 128 characters, the maximum
    assert contracts.decode(SUB, raw(doc), LIMIT)["operation_id"] == doc["operation_id"]


def test_the_provider_request_is_opaque_and_exact() -> None:
    """What a generation API takes passes, whatever its members; numbers come back exact."""
    data = (
        b'{"operation_id": "a", "submitted_at_ms": 0, "request": {"model": "genace-1", "input": {"prompt": "hi",'
        b' "max_tokens": 32}, "seed": 18446744073709551617, "temperature": 0.1000000000000000055511151231257827,'
        b' "scale": 1e400, "metadata": {"user": "u-1"}}}'
    )
    request = contracts.decode(SUB, data, LIMIT)["request"]
    assert request["seed"] == 2**64 + 1
    assert request["temperature"] == Decimal("0.1000000000000000055511151231257827")
    assert request["scale"] == Decimal("1e400")
    assert request["input"] == {"prompt": "hi", "max_tokens": 32}


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b'{"operation_id": "a", "submitted_at_ms": 0, "request": {"x": NaN}}', "NaN is not a JSON number"),
        (b'{"operation_id": "a", "submitted_at_ms": 0, "request": {"x": Infinity}}', "Infinity is not a JSON number"),
        (b'{"operation_id": "a", "submitted_at_ms": 0, "request": {"x": 1, "x": 2}}', "key 'x' appears twice"),
        (b'{"operation_id": "a", "operation_id": "b", "submitted_at_ms": 0, "request": {}}', "appears twice"),
    ],
)
def test_values_without_one_meaning_are_not_json(data: bytes, fragment: str) -> None:
    err = decode_error(SUB, data, limit=len(data))
    assert err.reason == "not_json"
    assert fragment in str(err)


def _nested_submission(levels: int) -> bytes:
    """A submission value nested ``levels`` deep in all (the envelope is level 1, the request level 2)."""
    inner = levels - 2
    return b'{"operation_id": "a", "submitted_at_ms": 0, "request": {"x": ' + b"[" * inner + b"]" * inner + b"}}"


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 300, 985, 100_000])
def test_values_nested_over_the_depth_limit_are_too_deep(levels: int) -> None:
    data = _nested_submission(levels)
    err = decode_error(SUB, data, limit=len(data))
    assert err.reason == "too_deep"
    assert str(err) == f"{SUB} value: nested more than {MAX_DEPTH} levels deep (at most {MAX_DEPTH} are read)"


@pytest.mark.parametrize("levels", [MAX_DEPTH - 1, MAX_DEPTH])
def test_values_at_the_depth_limit_are_read(levels: int) -> None:
    data = _nested_submission(levels)
    value = contracts.decode(SUB, data, len(data))
    assert exactjson.depth(value) == levels


@pytest.mark.parametrize("value", [[1, 2], "text", 3, None])
def test_json_but_not_an_object(value: Any) -> None:
    err = decode_error(SUB, raw(value))
    assert err.reason == "schema"
    assert str(err).startswith(f"{SUB} schema: at (root): ")


# --- decode: polls ---------------------------------------------------------------------------------------------


def test_valid_poll_passes() -> None:
    assert contracts.decode(POLLS, raw(VALID_POLL), LIMIT) == VALID_POLL


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"poll_claim_id": 0}, "poll_claim_id"),
        ({"poll_claim_id": "1"}, "poll_claim_id"),
        ({"remote_job_id": ""}, "remote_job_id"),
        ({"remote_job_id": "j" * 257}, "remote_job_id"),
        ({"claimed_at_ms": -5}, "claimed_at_ms"),
        ({"operation_id": "bad id"}, "operation_id"),
        ({"fencing_token": 3}, "(root)"),
    ],
)
def test_invalid_poll(change: dict[str, Any], where: str) -> None:
    err = decode_error(POLLS, raw({**VALID_POLL, **change}))
    assert err.reason == "schema"
    assert str(err).startswith(f"{POLLS} schema: at {where}: ")


def test_poll_missing_field() -> None:
    doc = {k: v for k, v in VALID_POLL.items() if k != "remote_job_id"}
    err = decode_error(POLLS, raw(doc))
    assert err.reason == "schema"
    assert "'remote_job_id' is a required property" in str(err)


# --- validate / dead letter ------------------------------------------------------------------------------------


def test_validate_rejects_bad_outgoing_value() -> None:
    with pytest.raises(InvalidEventError) as info:
        contracts.validate(POLLS, {**VALID_POLL, "poll_claim_id": 0})
    assert info.value.reason == "schema"
    assert str(info.value).startswith(f"{POLLS} schema: ")
    contracts.validate(POLLS, VALID_POLL)  # no error


@pytest.mark.parametrize(
    ("original", "key", "reason"),
    [
        (b"\xff\xfe{not json", b"conv-000001", "not_json"),
        (raw({"operation_id": "x"}), None, "schema"),
        (b"x" * 100, b"k", "oversized"),
        (None, None, "not_json"),
    ],
)
def test_dead_letter_envelope(original: bytes | None, key: bytes | None, reason: str) -> None:
    error = InvalidEventError(reason, f"{reason} happened")
    env = contracts.dead_letter(
        source_topic="x.generation.submissions",
        partition=3 if key else None,
        offset=17 if key else None,
        key=key,
        original=original,
        error=error,
        worker="worker-1",
    )
    contracts.validate(DLQ, env)
    assert base64.b64decode(env["original_base64"], validate=True) == (original or b"")
    if key is None:
        assert env["key_base64"] is None
    else:
        assert base64.b64decode(env["key_base64"], validate=True) == key
    assert env["reason"] == reason
    assert env["error"] == f"{reason} happened"
    assert env["source_topic"] == "x.generation.submissions"
    assert env["worker"] == "worker-1"
    assert isinstance(env["failed_at_ms"], int) and env["failed_at_ms"] > 1_600_000_000_000
    # The envelope survives a JSON round trip and decodes as a dead-letter value.
    assert contracts.decode(DLQ, orjson.dumps(env), LIMIT) == env


def test_dead_letter_from_a_real_decode_failure() -> None:
    original = b'{"operation_id": "a", "request": {"model": 12, "input": {"prompt": "hi"}}, "submitted_at_ms": 0}'
    err = decode_error(SUB, original)
    env = contracts.dead_letter(
        source_topic=SUB, partition=0, offset=0, key=b"a", original=original, error=err, worker="w"
    )
    contracts.validate(DLQ, env)
    assert env["reason"] == "schema"
    assert "request/model" in env["error"]
    assert base64.b64decode(env["original_base64"]) == original


def test_a_forbidden_field_is_explained_in_the_dead_letter_and_in_an_outgoing_check() -> None:
    doc = mutated(["request", "metadata"], {"client_reference": "zzz", "user": "u-1"})
    err = decode_error(SUB, raw(doc))
    env = contracts.dead_letter(
        source_topic=SUB, partition=0, offset=0, key=b"a", original=raw(doc), error=err, worker="w"
    )
    assert env["reason"] == "schema"  # the reason code stays; the text says why
    assert env["error"] == (
        f"{SUB} schema: at request/metadata/client_reference: a request may not carry metadata.client_reference: "
        "the product sends the operation id as the provider's client reference"
    )
    with pytest.raises(InvalidEventError) as info:
        contracts.validate(SUB, doc)
    assert "should not be valid" not in str(info.value)
    assert str(info.value) == (
        f"{SUB} schema: a request may not carry metadata.client_reference: the product sends the operation id as "
        "the provider's client reference"
    )


# --- numbers: exact or refused with the field ------------------------------------------------------------------

SUBMISSION_PREFIX = b'{"operation_id": "op-1", "request": {"input": {"prompt": "p", "max_tokens": 1}}, '

# submission text after the fixed prefix -> the decoded value of the field, or (reason, field, words)
SUBMISSION_NUMBERS: list[tuple[bytes, str, Any]] = [
    (b'"submitted_at_ms": 1, "source": {"n": 18446744073709551616}}', "source/n", 2**64),
    (b'"submitted_at_ms": 1, "source": {"n": 18446744073709551617}}', "source/n", 2**64 + 1),
    (b'"submitted_at_ms": 1, "source": {"n": -9223372036854775809}}', "source/n", -(2**63) - 1),
    (
        b'"submitted_at_ms": 1, "source": {"n": 0.1000000000000000055511151231257827}}',
        "source/n",
        Decimal("0.1000000000000000055511151231257827"),
    ),
    (b'"submitted_at_ms": 1, "source": {"n": 1e400}}', "source/n", Decimal("1e400")),
    (b'"submitted_at_ms": 253402300799999}', "submitted_at_ms", 253402300799999),
    (b'"submitted_at_ms": 1e3}', "submitted_at_ms", Decimal(1000)),  # an integer for JSON Schema
    (
        b'"submitted_at_ms": 18446744073709551616}',
        "submitted_at_ms",
        ("schema", "submitted_at_ms", "18446744073709551616 is greater than the maximum of 253402300799999"),
    ),
    (
        b'"submitted_at_ms": 253402300800000}',
        "submitted_at_ms",
        ("schema", "submitted_at_ms", "is greater than the maximum"),
    ),
    (b'"submitted_at_ms": 1.5}', "submitted_at_ms", ("schema", "submitted_at_ms", "1.5 is not of type 'integer'")),
    (b'"submitted_at_ms": 1, "source": {"n": NaN}}', "source/n", ("not_json", "source/n", "NaN is not a JSON number")),
    (
        b'"submitted_at_ms": 1, "source": {"n": -Infinity}}',
        "source/n",
        ("not_json", "source/n", "-Infinity is not a JSON number"),
    ),
    (b'"submitted_at_ms": 1, "source": {"n": 1e5000}}', "source/n", ("number_out_of_range", "source/n", "5001 digits")),
]


@pytest.mark.parametrize(
    ("rest", "field", "outcome"), SUBMISSION_NUMBERS, ids=[r[0][:60].decode() for r in SUBMISSION_NUMBERS]
)
def test_submission_numbers_are_exact_or_refused_naming_the_field(rest: bytes, field: str, outcome: Any) -> None:
    data = SUBMISSION_PREFIX + rest
    if isinstance(outcome, tuple):
        reason, where, words = outcome
        err = decode_error(SUB, data)
        assert err.reason == reason
        assert f"at {where}: " in str(err) and words in str(err)
        return
    value: Any = contracts.decode(SUB, data, LIMIT)
    for key in field.split("/"):
        value = value[key]
    assert value == outcome
    assert isinstance(value, Decimal) if isinstance(outcome, Decimal) else type(value) is int


def test_big_submission_numbers_are_written_back_exactly() -> None:
    data = SUBMISSION_PREFIX + b'"submitted_at_ms": 1, "source": {"a": 18446744073709551617, "b": 1.50}}'
    from streams.wire import exactjson

    assert exactjson.dumps(contracts.decode(SUB, data, LIMIT)["source"]) == b'{"a":18446744073709551617,"b":1.50}'


@pytest.mark.parametrize(
    ("change", "where", "words"),
    [
        (b'"poll_claim_id": 9223372036854775808', "poll_claim_id", "greater than the maximum"),
        (b'"poll_claim_id": 18446744073709551616', "poll_claim_id", "greater than the maximum"),
        (b'"claimed_at_ms": 18446744073709551616', "claimed_at_ms", "greater than the maximum"),
        (b'"poll_claim_id": NaN', "poll_claim_id", "NaN is not a JSON number"),
    ],
)
def test_poll_integers_out_of_range_are_refused(change: bytes, where: str, words: str) -> None:
    fields = {b'"poll_claim_id"': b'"poll_claim_id": 1', b'"claimed_at_ms"': b'"claimed_at_ms": 0'}
    name = change.split(b":")[0]
    fields[name] = change
    data = b'{"operation_id": "op", "remote_job_id": "j", ' + b", ".join(fields.values()) + b"}"
    err = decode_error(POLLS, data)
    assert f"at {where}: " in str(err) and words in str(err)


def test_interpreted_integers_have_a_maximum_in_every_schema() -> None:
    """Every integer field the system reads or writes is bounded, so nothing is rounded or overflows a column."""
    unbounded = []
    for topic in contracts.SCHEMA_FILES:
        schema = orjson.loads(contracts.schema_dir().joinpath(contracts.SCHEMA_FILES[topic]).read_bytes())
        stack = [("", schema)]
        while stack:
            where, node = stack.pop()
            if isinstance(node, dict):
                types = node.get("type")
                if (types == "integer" or (isinstance(types, list) and "integer" in types)) and "maximum" not in node:
                    unbounded.append(f"{topic}:{where}")
                stack.extend((f"{where}/{k}", v) for k, v in node.items())
    # ``source`` is not interpreted: its numbers are carried exactly, whatever their size.
    assert unbounded == ["generation.submissions:/properties/source/additionalProperties"]


def test_latest_time_is_the_same_everywhere() -> None:
    from streams.remote.client import MAX_EPOCH_MS

    sub = orjson.loads(contracts.schema_dir().joinpath("generation.submissions.json").read_bytes())
    assert sub["properties"]["submitted_at_ms"]["maximum"] == MAX_EPOCH_MS
    latest = dt.datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=dt.UTC)
    assert (latest - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(milliseconds=1) == MAX_EPOCH_MS


@pytest.mark.parametrize(
    "operation_id",
    ["a", "conv-000001", "A.b_c:d-9", "x" * 128, "x" * 129, "-a", ".a", "a b", "a\x00b", "a\n", "é", "", "a/b"],
)
def test_the_operation_id_pattern_is_the_submissions_schemas(operation_id: str) -> None:
    """The live view refuses a path that is no operation id before it reaches the ledger, by the same rule."""
    value = {"operation_id": operation_id, "request": {}, "submitted_at_ms": 0}
    try:
        contracts.decode("generation.submissions", orjson.dumps(value), 1 << 20)
        by_schema = True
    except InvalidEventError as exc:
        by_schema = "at operation_id:" not in str(exc)  # refused for another member: the id itself passed
    assert (OPERATION_ID.fullmatch(operation_id) is not None) is by_schema
