"""``streams dead-letters redrive`` refuses a dead letter whose id the ledger no longer holds (``streams purge
--ids-older-than`` freed it) when the id was sent to the provider before, or the letter was refused as a duplicate of
it: re-driven, it would run again as a new operation (:func:`streams.oncall.deadletters.check_redrive`, pure)."""

from __future__ import annotations

import base64

import orjson
import pytest

from streams.config import Settings
from streams.oncall.deadletters import DeadLetter, check_redrive

SETTINGS = Settings.from_env().replace(topic_prefix="t.")
REQUEST = {"input": {"prompt": "p", "max_tokens": 1}}


def value(op: str) -> bytes:
    return orjson.dumps({"operation_id": op, "request": REQUEST, "submitted_at_ms": 1})


def letter(reason: str, op: str = "op-1") -> DeadLetter:
    envelope = {
        "source_topic": SETTINGS.topic("submissions"),
        "reason": reason,
        "original_base64": base64.b64encode(value(op)).decode(),
    }
    return DeadLetter(0, 7, 1, envelope)


@pytest.mark.parametrize(
    ("reason", "ledger_request", "former_posts", "refused"),
    [
        ("key_mismatch", None, 0, None),  # never seen: a new operation
        ("key_mismatch", None, 2, "was asked for operation op-1 before (2 POST attempts"),  # its id was freed
        ("conflicting_duplicate", None, 0, "refused as a duplicate of operation op-1"),  # cancelled before its POST
        ("conflicting_duplicate", None, 1, "was asked for operation op-1 before (1 POST attempts"),
        ("key_mismatch", orjson.dumps(REQUEST).decode(), 0, None),  # held with the same request: a replay, harmless
    ],
)
def test_a_dead_letter_of_a_freed_id_is_not_redriven_with_it(
    reason: str, ledger_request: str | None, former_posts: int, refused: str | None
) -> None:
    op, why = check_redrive(SETTINGS, letter(reason), value("op-1"), "original", ledger_request, former_posts)
    assert op == "op-1"
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why and "freed its id" in why


def test_a_fixed_value_with_a_new_id_is_redriven() -> None:
    """The way out the refusal names: the same request under a new operation id."""
    assert check_redrive(SETTINGS, letter("conflicting_duplicate"), value("op-2"), "file", None, 0) == ("op-2", None)
