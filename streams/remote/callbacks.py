"""The provider's completion callbacks as Standard Webhooks: signature verification and the job id they name.

Source of the rules: the Standard Webhooks specification
(https://github.com/standard-webhooks/standard-webhooks/blob/main/spec/standard-webhooks.md):

* headers ``webhook-id`` (the delivery's id, the same on every retry of it), ``webhook-timestamp`` (integer unix
  seconds) and ``webhook-signature``: space-separated ``v1,<base64 HMAC-SHA256>`` entries (other versions are
  skipped), any one of which may match;
* the signed content is ``{webhook-id}.{webhook-timestamp}.{raw body}``, the key the base64 after ``whsec_``;
* a timestamp further than the tolerance from the receiver's clock is refused (replay protection beside the
  webhook-id record);
* several keys are tried during a rotation; comparison in constant time.

The body names the job as ``data.id`` (``{"type": "generation.completed", "timestamp": ..., "data": {"id": ...,
"status": ...}}``); nothing else of it is used: the state is read by a GET.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping, Sequence

import orjson

from streams.errors import CallbackRefusedError
from streams.model.answers import JOB_ID
from streams.model.codes import CallbackRefusal

#: The signature scheme version this receiver checks (the specification's symmetric HMAC-SHA256).
SIGNATURE_VERSION = "v1"
#: Longest webhook-id accepted (characters); the id is a key of the ledger's record of deliveries.
MAX_WEBHOOK_ID_CHARS = 200
#: Most digits of a webhook-timestamp (unix seconds; 12 reach the year 33000).
MAX_TIMESTAMP_DIGITS = 12


def signature(key: bytes, webhook_id: str, timestamp_s: int, body: bytes) -> str:
    """The ``v1,<base64>`` signature of ``body`` sent as ``webhook_id`` at ``timestamp_s`` (unix s) with ``key``."""
    content = f"{webhook_id}.{timestamp_s}.".encode() + body
    digest = hmac.new(key, content, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def verify(headers: Mapping[str, str], body: bytes, keys: Sequence[bytes], *, tolerance_s: float, now_s: float) -> str:
    """The ``webhook-id`` of a callback whose signature one of ``keys`` made, with a timestamp within
    ``tolerance_s`` of ``now_s`` (unix s). ``headers`` is case-insensitive as aiohttp's (or lower-case names).

    Raises:
        CallbackRefusedError: ``malformed_headers`` (400: a header missing, empty, too long or not an integer
            timestamp), ``stale_timestamp`` (401) or ``bad_signature`` (401: no ``v1`` entry matches any key).
    """
    webhook_id = (headers.get("webhook-id") or "").strip()
    timestamp_text = (headers.get("webhook-timestamp") or "").strip()
    signatures = (headers.get("webhook-signature") or "").split()
    if not webhook_id or len(webhook_id) > MAX_WEBHOOK_ID_CHARS or not webhook_id.isprintable():
        raise CallbackRefusedError(CallbackRefusal.MALFORMED_HEADERS, 400, "webhook-id missing, empty or too long")
    if not timestamp_text.isascii() or not timestamp_text.isdigit() or len(timestamp_text) > MAX_TIMESTAMP_DIGITS:
        raise CallbackRefusedError(
            CallbackRefusal.MALFORMED_HEADERS, 400, "webhook-timestamp is not integer unix seconds"
        )
    if not signatures:
        raise CallbackRefusedError(CallbackRefusal.MALFORMED_HEADERS, 400, "webhook-signature missing")
    timestamp_s = int(timestamp_text)
    if abs(now_s - timestamp_s) > tolerance_s:
        raise CallbackRefusedError(
            CallbackRefusal.STALE_TIMESTAMP,
            401,
            f"webhook-timestamp {timestamp_s} is {now_s - timestamp_s:.0f} s from this clock (tolerance "
            f"{tolerance_s:.0f} s); check the sender's clock",
        )
    expected = [signature(key, webhook_id, timestamp_s, body).encode() for key in keys]
    for entry in signatures:
        version, _, _ = entry.partition(",")
        if version != SIGNATURE_VERSION or not entry.isascii():  # base64 is ASCII; undecodable bytes never match
            continue
        if any(hmac.compare_digest(entry.encode(), e) for e in expected):
            return webhook_id
    raise CallbackRefusedError(
        CallbackRefusal.BAD_SIGNATURE, 401, f"no v1 signature of delivery {webhook_id!r} matches a configured secret"
    )


def job_id_of(body: bytes) -> str:
    """The job id a verified callback body names (``data.id``).

    Raises:
        CallbackRefusedError: ``malformed_body`` (400): not a JSON object whose ``data.id`` is a job id as the
            provider's answers are read (:data:`streams.model.answers.JOB_ID`: no NUL, space or ``/``, which the
            ledger could not look up or no job can have).
    """
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise CallbackRefusedError(CallbackRefusal.MALFORMED_BODY, 400, "the body is not JSON") from None
    data = document.get("data") if isinstance(document, dict) else None
    job_id = data.get("id") if isinstance(data, dict) else None
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        raise CallbackRefusedError(CallbackRefusal.MALFORMED_BODY, 400, "the body names no job (data.id)")
    return job_id
