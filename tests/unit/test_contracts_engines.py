"""The two schema engines of :mod:`streams.wire.contracts` agree: jsonschema-rs (which decides whether a consumed value
conforms) and jsonschema (the reference, which names the failing field) give the same verdict on valid values
of every topic and on many invalid ones derived from them, field by field: each required field dropped, each
field replaced by values of every JSON type and by edge values (limits, limits plus one, integral decimals, huge
integers, strings one character past a pattern), and an unknown field added."""

from __future__ import annotations

import copy
import itertools
from decimal import Decimal
from typing import Any

import pytest

from streams.errors import InvalidEventError
from streams.wire import contracts

VALID: dict[str, dict[str, Any]] = {
    "generation.submissions": {
        "operation_id": "conv-000001",
        "request": {"model": "genace-1", "input": {"prompt": "Write a haiku", "max_tokens": 32}, "metadata": {}},
        "submitted_at_ms": 1_700_000_000_000,
        "source": {"trace": "conv", "row": 0, "big": 2**80, "none": None},
    },
    "generation.polls": {
        "operation_id": "conv-000001",
        "remote_job_id": "job-1",
        "poll_claim_id": 1,
        "claimed_at_ms": 0,
    },
    "generation.transitions": {
        "event_id": "transition:conv-000001:1",
        "operation_id": "conv-000001",
        "seq": 1,
        "from_state": None,
        "to_state": "accepted",
        "fencing_token": 0,
        "remote_job_id": None,
        "reason": None,
        "at_ms": 1_700_000_000_000,
    },
    "generation.outputs.delivered": {
        "event_id": "output:conv-000001:0",
        "operation_id": "conv-000001",
        "output_id": "out-0",
        "position": 0,
        "remote_job_id": "job-1",
        "output": {"text": "leases", "seed": 2**70},
        "remote_completed_at_ms": None,
        "recorded_at_ms": 1_700_000_000_000,
    },
    "generation.dead-letter": contracts.dead_letter(
        source_topic="generation.submissions",
        partition=3,
        offset=42,
        key=b"conv-000001",
        original=b"{not json",
        error=InvalidEventError("not_json", "value is not JSON"),
        worker="host:1",
    ),
}

#: Values of every JSON type and the edges the schemas draw (limits of integer fields, patterns' anchors).
REPLACEMENTS: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    2**80,
    -(2**80),
    253402300799999,
    253402300800000,
    Decimal("5.0"),
    Decimal("5.5"),
    Decimal("1E+2"),
    Decimal("253402300799999.0000001"),
    "",
    "a",
    "conv-000001",
    "conv-000001\n",
    " conv",
    "é",
    "x" * 128,
    "x" * 129,
    "transition:x",
    "output:x",
    "accepted",
    "nonsense",
    [],
    ["a"],
    {},
    {"client_reference": "x"},
]


def _variants(value: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [value, {**value, "unexpected_field": 1}]
    for key in value:
        out.append({k: v for k, v in value.items() if k != key})
        for replacement in REPLACEMENTS:
            out.append({**value, key: copy.deepcopy(replacement)})
        if isinstance(value[key], dict):  # one level down: the request, its metadata, a source, an output
            for inner, replacement in itertools.product([*value[key], "metadata", "model"], REPLACEMENTS):
                out.append({**value, key: {**value[key], inner: copy.deepcopy(replacement)}})
    return out


@pytest.mark.parametrize("topic", sorted(VALID))
def test_both_engines_give_the_same_verdict(topic: str) -> None:
    fast, reference = contracts.fast_validator(topic), contracts.validator(topic)
    verdicts = {True: 0, False: 0}
    disagreements = []
    for value in _variants(VALID[topic]):
        expected = next(iter(reference.iter_errors(value)), None) is None
        try:
            got = fast.is_valid(value)
        except ValueError:  # a type jsonschema-rs does not take: decided by the reference alone
            continue
        verdicts[expected] += 1
        if got != expected:
            disagreements.append((value, expected, got))
    assert disagreements == []
    assert verdicts[True] >= 5 and verdicts[False] >= 50, verdicts  # both verdicts were really compared


@pytest.mark.parametrize("topic", sorted(VALID))
def test_schema_error_names_the_field_as_the_reference_does(topic: str) -> None:
    bad = {**VALID[topic], next(iter(VALID[topic])): []}
    error = contracts.schema_error(topic, bad)
    assert error is not None and error.startswith(f"at {next(iter(VALID[topic]))}: ")
    assert contracts.schema_error(topic, VALID[topic]) is None
