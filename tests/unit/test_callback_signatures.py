"""Standard Webhooks verification of completion callbacks (streams.remote.callbacks, docs/callbacks.md), against the
specification's published test vector, rotated secrets, stale timestamps and malformed headers."""

from __future__ import annotations

import base64

import orjson
import pytest

from streams.config import Settings, callback_secret_key
from streams.errors import CallbackRefusedError, ConfigError
from streams.model.codes import CallbackRefusal
from streams.remote.callbacks import job_id_of, signature, verify

# The Standard Webhooks specification's test vector (reproduced by its reference libraries).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

OTHER_SECRET = "whsec_" + base64.b64encode(b"another endpoint secret, rotated").decode()
KEY = callback_secret_key(SPEC_SECRET)
OTHER_KEY = callback_secret_key(OTHER_SECRET)


def headers(sig: str = SPEC_SIGNATURE, ts: str = str(SPEC_TIMESTAMP), wid: str = SPEC_ID) -> dict[str, str]:
    return {"webhook-id": wid, "webhook-timestamp": ts, "webhook-signature": sig}


def refusal(h: dict[str, str], keys: list[bytes], *, now_s: float = SPEC_TIMESTAMP, body: bytes = SPEC_BODY) -> str:
    with pytest.raises(CallbackRefusedError) as caught:
        verify(h, body, keys, tolerance_s=300, now_s=now_s)
    assert SPEC_SIGNATURE not in str(caught.value) and body.decode() not in str(caught.value)
    return f"{caught.value.reason.value}/{caught.value.status}"


def test_signs_like_the_specification() -> None:
    assert signature(KEY, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE


def test_accepts_the_specification_vector_and_returns_the_webhook_id() -> None:
    assert verify(headers(), SPEC_BODY, [KEY], tolerance_s=300, now_s=SPEC_TIMESTAMP + 10) == SPEC_ID


def test_rotation_any_configured_key_and_any_v1_entry_may_match() -> None:
    assert verify(headers(), SPEC_BODY, [OTHER_KEY, KEY], tolerance_s=300, now_s=SPEC_TIMESTAMP) == SPEC_ID
    other = signature(OTHER_KEY, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY)
    both = f"v2,unknownscheme {other} {SPEC_SIGNATURE}"
    assert verify(headers(both), SPEC_BODY, [KEY], tolerance_s=300, now_s=SPEC_TIMESTAMP) == SPEC_ID


def test_bad_signatures_are_401() -> None:
    assert refusal(headers(), [OTHER_KEY]) == "bad_signature/401"
    assert refusal(headers(), [KEY], body=b'{"test": 2432232315}') == "bad_signature/401"
    assert refusal(headers(wid="msg_other"), [KEY]) == "bad_signature/401"
    assert refusal(headers(SPEC_SIGNATURE.replace("v1,", "v1a,")), [KEY]) == "bad_signature/401"
    assert refusal(headers("v1,"), [KEY]) == "bad_signature/401"


def test_a_timestamp_beyond_the_tolerance_is_stale_either_way() -> None:
    assert refusal(headers(), [KEY], now_s=SPEC_TIMESTAMP + 301) == "stale_timestamp/401"
    assert refusal(headers(), [KEY], now_s=SPEC_TIMESTAMP - 301) == "stale_timestamp/401"
    assert verify(headers(), SPEC_BODY, [KEY], tolerance_s=300, now_s=SPEC_TIMESTAMP + 300) == SPEC_ID


@pytest.mark.parametrize(
    "h",
    [
        {"webhook-timestamp": str(SPEC_TIMESTAMP), "webhook-signature": SPEC_SIGNATURE},
        headers(wid=" "),
        headers(wid="x" * 201),
        headers(ts=""),
        headers(ts="1614265330.5"),
        headers(ts="-1614265330"),
        headers(ts="1" * 13),
        headers(ts="\u0661\u0666"),  # Arabic-Indic digits: str.isdigit, not ASCII
        headers(sig=""),
        {"webhook-id": SPEC_ID, "webhook-timestamp": str(SPEC_TIMESTAMP)},
    ],
)
def test_malformed_headers_are_400(h: dict[str, str]) -> None:
    assert refusal(h, [KEY]) == "malformed_headers/400"


def test_the_body_names_the_job_as_data_id() -> None:
    assert job_id_of(b'{"type": "generation.completed", "data": {"id": "job_1", "status": "succeeded"}}') == "job_1"
    for body in (b"not json", b"[]", b'{"data": {}}', b'{"data": {"id": ""}}', b'{"data": {"id": 7}}'):
        with pytest.raises(CallbackRefusedError) as caught:
            job_id_of(body)
        assert caught.value.reason is CallbackRefusal.MALFORMED_BODY and caught.value.status == 400


def test_settings_read_rotated_secrets_and_refuse_a_malformed_one() -> None:
    s = Settings(callbacks_enabled=True, callback_secrets=f"{SPEC_SECRET} {OTHER_SECRET}")
    assert s.callback_secret_keys == (KEY, OTHER_KEY)
    assert SPEC_SECRET not in repr(s) and SPEC_SECRET not in str(s)
    with pytest.raises(ConfigError, match="CALLBACK_SECRETS") as caught:
        Settings(callbacks_enabled=True, callback_secrets="whsec_not*base64")
    assert "not*base64" not in str(caught.value)
    with pytest.raises(ConfigError, match="CALLBACK_SECRETS"):
        Settings(callbacks_enabled=True)
    with pytest.raises(ConfigError, match="CALLBACK_SECRETS"):
        Settings(callbacks_enabled=True, callback_secrets="whsec_")  # an empty key would let anyone sign


def test_a_signature_header_of_undecodable_bytes_is_a_bad_signature_not_a_crash() -> None:
    # aiohttp decodes header bytes that are not UTF-8 with surrogateescape: such an entry never matches, and a valid
    # entry beside it still does.
    undecodable = b"v1,\xff\xfe".decode("utf-8", "surrogateescape")
    assert refusal(headers(undecodable), [KEY]) == "bad_signature/401"
    assert refusal(headers("v1,signé"), [KEY]) == "bad_signature/401"
    assert verify(headers(f"{undecodable} {SPEC_SIGNATURE}"), SPEC_BODY, [KEY], tolerance_s=300, now_s=SPEC_TIMESTAMP)


@pytest.mark.parametrize(
    "job_id",
    ["job\u0000x", "job 1", "../job_1", "job/1", "%2Fjob", "\u00e9job", "j" * 257, " job_1"],
)
def test_a_data_id_no_job_can_have_is_a_malformed_body(job_id: str) -> None:
    # A NUL reached PostgreSQL, which refused the text (500); a job id the provider's answers would not be read
    # with (streams.model.answers.JOB_ID) names no operation.
    body = b'{"data": {"id": ' + orjson.dumps(job_id) + b"}}"
    with pytest.raises(CallbackRefusedError) as caught:
        job_id_of(body)
    assert caught.value.reason is CallbackRefusal.MALFORMED_BODY and job_id not in str(caught.value)


def test_deep_nesting_and_big_integers_are_a_malformed_body() -> None:
    for body in (b"[" * 100_000, b'{"data": {"id": "job_1"}, "n": ' + b"9" * 5000 + b"}"):
        with pytest.raises(CallbackRefusedError) as caught:
            job_id_of(body)
        assert caught.value.reason is CallbackRefusal.MALFORMED_BODY
