"""The provider's free text kept from echoing the request (streams/remote/redaction.py) and a failed job's reason
without the provider's sentences (streams.model.answers.failed_reason): both reach logs, the transitions topic and
the live view, where no prompt may go."""

from __future__ import annotations

import orjson
import pytest

from streams.model.answers import failed_reason
from streams.remote.redaction import REDACTED, without_request_echoes

PROMPT = "MY-PRIVATE-PROMPT-TEXT: tell me about the object in the picture"
REQUEST = orjson.dumps({"model": "genace-1", "input": {"prompt": PROMPT, "max_tokens": 8}, "tags": ["abc", "secret-1"]})


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        # the simulator's own refusal: the whole value quoted
        (f"at input: '{PROMPT}' is not of type 'object'", f"at input: '{REDACTED}' is not of type 'object'"),
        # a piece of the prompt quoted (cut by the provider), in double and typographic quotes
        ('prompt "MY-PRIVATE-PROMPT" is too long', f'prompt "{REDACTED}" is too long'),
        ("value \u201ctell me about the\u201d refused", f"value \u201c{REDACTED}\u201d refused"),
        # a value written without quotes
        (f"bad tag secret-1 in {PROMPT}!", f"bad tag {REDACTED} in {REDACTED}!"),
        # short values and short quoted words stay: the provider's words hold them too
        ("model 'genace-1' has no field 'abc'", f"model '{REDACTED}' has no field 'abc'"),
        ("max_tokens must be at most 4096", "max_tokens must be at most 4096"),
        ("'object' expected", "'object' expected"),
    ],
)
def test_what_the_provider_quotes_of_the_request_is_redacted(message: str, expected: str) -> None:
    assert without_request_echoes(message, REQUEST.decode()) == expected


def test_a_request_that_is_not_json_is_one_value() -> None:
    assert without_request_echoes("bad body: {not json at all", "{not json at all") == f"bad body: {REDACTED}"


def test_a_failed_jobs_reason_keeps_its_codes_not_its_sentences() -> None:
    error = {"code": "content_filter", "message": f"refused: {PROMPT}", "retryable": False, "status": 451}
    reason = failed_reason(error)
    assert reason == (
        'remote job failed: {"code":"content_filter","retryable":false,"status":451} '
        "(the provider's words: the operation's last observation)"
    )
    assert "PRIVATE" not in failed_reason({"message": PROMPT}) and "no code" in failed_reason({"message": PROMPT})
    assert "PRIVATE" not in failed_reason({"type": PROMPT[:30]})  # a text with a blank is no code
