"""JSON text carried as it is: member spans, appended members, canonical forms, and the POST body built from
the provider's request."""

from __future__ import annotations

import json
import random
from decimal import Decimal
from typing import Any

import pytest

from streams.errors import InvalidEventError
from streams.remote.client import provider_request_body
from streams.wire import exactjson, jsontext

OP = "op-1"
MODEL = "sim-1"

#: Values that orjson or a double would change, and strings whose escapes must survive.
EXACT_REQUEST = (
    '{"model": "genace-1", "input": {"prompt": "Write a haiku about leases \\u00e9\\n\\"\\\\\\u0000 \\ud83d\\ude00'
    ' h\u00e9 \u2603 \U0001f600", "max_tokens": 32}, "seed": 18446744073709551617, "neg": -18446744073709551617,'
    ' "t": 0.1000000000000000055511151231257827, "huge": 1e400, "tiny": 1E-400, "trail": 1.50, "z": -0.0,'
    ' "flags": [true, false, null], "metadata": {"user": "u-1"}}'
)


def body_text(request: str, operation_id: str = OP, model: str = MODEL) -> str:
    return provider_request_body(request, operation_id, model).decode("utf-8")


def test_the_generation_api_example_gets_only_the_client_reference() -> None:
    request = '{"model": "genace-1", "input": {"prompt": "Write a haiku about leases", "max_tokens": 32}}'
    assert body_text(request) == request[:-1] + ',"metadata":{"client_reference":"op-1"}}'


def test_model_default_only_when_absent() -> None:
    assert body_text('{"input": {}}') == '{"input": {},"model":"sim-1","metadata":{"client_reference":"op-1"}}'
    assert body_text("{}") == '{"model":"sim-1","metadata":{"client_reference":"op-1"}}'
    assert body_text(" { \n } \n") == ' { \n "model":"sim-1","metadata":{"client_reference":"op-1"}} \n'


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ('{"user": "u-1"}', '{"user": "u-1","client_reference":"op-1"}'),
        ("{}", '{"client_reference":"op-1"}'),
        ("{ }", '{ "client_reference":"op-1"}'),
        ('{"a": {"b": [1, {}]}}  ', '{"a": {"b": [1, {}]},"client_reference":"op-1"}'),
    ],
)
def test_client_reference_goes_into_the_request_metadata(metadata: str, expected: str) -> None:
    request = '{"model": "m", "metadata": ' + metadata + ', "z": 1}'
    spaced = metadata.rstrip()  # members() spans the value only, so trailing blanks stay outside it
    assert body_text(request) == '{"model": "m", "metadata": ' + expected + metadata[len(spaced) :] + ', "z": 1}'


def test_every_character_of_the_request_is_kept() -> None:
    body = body_text(EXACT_REQUEST)
    assert body == EXACT_REQUEST.replace('"user": "u-1"}', '"user": "u-1","client_reference":"op-1"}')
    value = exactjson.loads(body)
    assert value["seed"] == 2**64 + 1 and value["neg"] == -(2**64) - 1
    assert value["t"] == Decimal("0.1000000000000000055511151231257827")
    assert value["huge"] == Decimal("1e400") and value["tiny"] == Decimal("1e-400")
    assert value["input"]["prompt"] == 'Write a haiku about leases \u00e9\n"\\\x00 \U0001f600 h\u00e9 \u2603 \U0001f600'
    assert value["metadata"] == {"user": "u-1", "client_reference": OP}


def test_operation_ids_and_models_are_json_escaped() -> None:
    body = exactjson.loads(body_text("{}", operation_id='a"b', model="m\u00e9"))
    assert body == {"model": "m\u00e9", "metadata": {"client_reference": 'a"b'}}


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randrange(-(2**70), 2**70)
    if kind == 2:
        return Decimal(f"{rng.randrange(-(10**20), 10**20)}e{rng.randrange(-500, 500)}")
    if kind in (3, 4):
        return "".join(rng.choice('ab"\\\n\u00e9\u2603\U0001f600 \x00/') for _ in range(rng.randrange(6)))
    if kind == 5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = {"".join(rng.choice('kmé"') for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(4))}
    keys -= {"model", "metadata"}
    return {k: _random_value(rng, depth + 1) for k in keys}


def _dumps(value: Any, rng: random.Random) -> str:
    """JSON text of ``value`` with random blanks and escapes (numbers written from their exact text)."""

    def blank() -> str:
        return rng.choice(["", " ", "\n  ", "\t"])

    if isinstance(value, dict):
        parts = [
            f"{blank()}{json.dumps(k, ensure_ascii=rng.random() < 0.5)}{blank()}:{blank()}{_dumps(v, rng)}"
            for k, v in value.items()
        ]
        return "{" + ",".join(parts) + blank() + "}"
    if isinstance(value, list):
        return "[" + ",".join(blank() + _dumps(v, rng) for v in value) + blank() + "]"
    if isinstance(value, Decimal):
        return str(value)
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


@pytest.mark.parametrize("seed", range(200))
def test_random_requests_reach_the_body_with_the_same_values(seed: int) -> None:
    rng = random.Random(seed)
    request = _random_value(rng, 3) if seed % 3 else {}
    request = request if isinstance(request, dict) else {"v": request}
    if seed % 2:
        request["metadata"] = {"m": _random_value(rng, 2)}
    text = _dumps(request, rng)
    body = exactjson.loads(body_text(text))
    expected = dict(request, model=MODEL)
    expected["metadata"] = dict(request.get("metadata", {}), client_reference=OP)
    assert jsontext.canonical(body) == jsontext.canonical(expected)


# --- members and canonical forms -------------------------------------------------------------------------------


def test_members_give_the_verbatim_value_texts() -> None:
    text = ' {"a" : 1.50 , "b":{"c": [1, "}"]}, "\\u00e9": "x\\"y"}  '
    assert jsontext.member_texts(text) == {"a": "1.50", "b": '{"c": [1, "}"]}', "\u00e9": '"x\\"y"'}
    assert jsontext.members("{}") == []


@pytest.mark.parametrize("text", ["[1]", '"a"', "", "  "])
def test_members_of_a_non_object(text: str) -> None:
    with pytest.raises(InvalidEventError, match="expected a JSON object"):
        jsontext.members(text)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ('{"a": 1, "b": 2}', '{"b": 2, "a": 1}'),
        ("5", "5.0"),
        ("5", "0.5e1"),
        ("50", "5e1"),
        ("1e400", "10e399"),
        ("0", "-0.0"),
        ('"\\u00e9\\n"', '"\u00e9\\u000a"'),
        ("18446744073709551617", "18446744073709551617.000"),
    ],
)
def test_canonical_forms_agree_on_equal_meanings(a: str, b: str) -> None:
    assert jsontext.canonical(exactjson.loads(a)) == jsontext.canonical(exactjson.loads(b))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("true", "1"),
        ("false", "0"),
        ("null", "0"),
        ("1", '"1"'),
        ("18446744073709551617", "18446744073709551616"),
        ("0.1000000000000000055511151231257827", "0.1"),
        ("[1, 2]", "[2, 1]"),
        ('{"a": 1}', '{"a": 1, "b": null}'),
    ],
)
def test_canonical_forms_differ_on_different_meanings(a: str, b: str) -> None:
    assert jsontext.canonical(exactjson.loads(a)) != jsontext.canonical(exactjson.loads(b))
