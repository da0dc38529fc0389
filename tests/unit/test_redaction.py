"""The provider's free text kept from echoing the request (streams/remote/redaction.py) and a failed job's reason
without the provider's sentences (streams.model.answers.failed_reason): both reach logs, the transitions topic and
the live view, where no prompt may go."""

from __future__ import annotations

import orjson
import pytest

from streams.model.answers import failed_reason
from streams.remote.redaction import MAX_TEXT_CHARS, REDACTED, without_request_echoes

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


@pytest.mark.parametrize(
    ("value", "message"),
    [
        # Python's repr of a prompt with a line break (jsonschema's message, the simulator's)
        ("first line of secret\nsecond line of secret", "'first line of secret\\nsecond line of secret' is bad"),
        ("both 'single' and \"double\" quotes here", "value 'both \\'single\\' and \"double\" quotes here' refused"),
        ("un café très secret", 'prompt "un caf\\u00e9 tr\\u00e8s secret" refused'),  # JSON escapes
        # pydantic's shortened form: the start and the end of the value around "..."
        (
            "Tell me everything about the patient born 1970-01-01, diagnosis X",
            "input_value='Tell me everything about ...0-01-01, diagnosis X'",
        ),
    ],
)
def test_a_value_written_back_escaped_or_shortened_is_redacted(value: str, message: str) -> None:
    request = orjson.dumps({"input": value}).decode()
    out = without_request_echoes(message, request)
    assert REDACTED in out
    for word in ("secret", "patient", "diagnosis", "single"):
        assert word not in out or word not in value


def test_a_short_value_inside_a_quoted_part_does_not_save_the_rest_of_it() -> None:
    request = orjson.dumps({"user": "Jane", "input": "Patient Jane Roe has condition Q and more"}).decode()
    out = without_request_echoes("refused 'Patient Jane Roe has condition Q...'", request)
    assert out == f"refused '{REDACTED}'"


def test_the_text_is_cut_before_it_is_redacted_and_a_value_it_ends_inside_goes_too() -> None:
    prompt = "confidential " * 1000  # 13,000 characters
    request = orjson.dumps({"input": prompt.strip()}).decode()
    out = without_request_echoes("x" * (MAX_TEXT_CHARS - 100) + " " + prompt, request)
    assert "confidential" not in out and out.endswith(REDACTED)
    assert len(out) <= MAX_TEXT_CHARS


def test_values_that_are_pieces_of_the_marker_do_not_nest_or_grow_the_text() -> None:
    """Each value was replaced in turn, so later values matched inside the markers already written: 65 such values
    turned a 3,200-character message into 959,528,600 characters."""
    words = ["text", "request", "<request", "text>", "quest", "eques", "uest t"]
    request = orjson.dumps({"tools": [{"type": w} for w in words], "input": "the real prompt here"}).decode()
    message = "context json_object; " * 150 + "'the real prompt here'"
    out = without_request_echoes(message, request)
    assert len(out) <= 2 * len(message) and "the real prompt" not in out
    assert without_request_echoes("a text here", orjson.dumps({"t": "text"}).decode()) == f"a {REDACTED} here"


def test_an_end_inside_a_value_is_found_past_an_earlier_start_of_it() -> None:
    memo = "Translate the following confidential memo into French: " + "secret detail " * 40
    request = orjson.dumps({"input": memo}).decode()
    message = "Translate request failed: input 'Translate the following confidential memo into"
    out = without_request_echoes(message, request)
    assert "confidential" not in out and out.endswith(REDACTED)


def test_the_clients_own_words_for_a_failure_it_decided_stay_in_the_reason() -> None:
    """A contract violation is this client's verdict, named by field without values: its words are the reason."""
    error = {"code": "contract_violation", "message": "at outputs/0/score: NaN is not a JSON number"}
    reason = failed_reason(error, error["message"])
    assert reason == ('remote job failed: {"code":"contract_violation"}: at outputs/0/score: NaN is not a JSON number')
