"""The remote generation API client: one place for timeouts, auth, status mapping and error taxonomy.

Classification (docs/design.md, "Contracts at the edges"):

=============================================== ================================== =====================
what happened                                   result                             POST retried?
=============================================== ================================== =====================
2xx with ``id``                                 :class:`SubmitResult` (created)    --
502 with ``error.job_id``                       :class:`SubmitResult` (created)    --
429, or a 4xx whose ``error.code`` is one of   :class:`RemoteRateLimitedError`    yes, after Retry-After
``remote_throttled_codes`` (throttled)
other 4xx (400, 401, 403, 409, 422, ...)        :class:`RemoteRefusedError`        no (ends ``rejected``)
connection refused / not established / no       :class:`RemoteNotSentError`        yes (nothing was sent)
pooled connection free (no byte sent)
timeout or connection lost after send, 5xx      :class:`RemoteUnknownOutcomeError` no (ends ``uncertain``)
without job id, 2xx without a readable id, an
answer whose Content-Encoding does not decode,
an answer over ``remote_answer_max_bytes``
=============================================== ================================== =====================

The cancel route (``POST`` ``remote_cancel_path``, :meth:`RemoteClient.cancel`) never raises: its answer is a
:class:`CancelResult` whose outcome is ``cancel_accepted`` (2xx), ``cancel_already_terminal`` (409: the job ended
first), ``cancel_refused`` (another 4xx) -- definite, never asked again -- or ``cancel_not_found`` (404: a job just
created may not be listed yet) and ``cancel_unknown_outcome`` (429, 5xx, timeouts, connection errors) -- asked again
at the job's next poll, up to ``cancel_attempt_limit`` calls (docs/cancellation.md).

Every answer's body is read within ``remote_answer_max_bytes`` (decoded or not: a compressed answer is decoded
as it arrives and cut off at the limit, :class:`streams.remote.transport.BoundedBody`), whatever the transport.

Answers are read with every number exact (:mod:`streams.wire.exactjson`). A 2xx whose body cannot be read exactly
(``NaN``, a number too long) counts as "without a readable id"; on a GET, such a 200 is a contract violation
naming the field. ``Retry-After`` is read by :func:`parse_retry_after_s`, ``completed_at`` by
:func:`read_completed_at_ms`.

Every call (POST and GET) runs under one overall deadline, ``remote_call_deadline_s`` (``asyncio.timeout``
around the whole request: pool wait, connect, send and the entire answer), on top of httpx's per-phase
timeouts: a provider trickling its answer one byte per read timeout cannot keep a call open. Whether the
deadline struck before or after the request was sent is read from httpcore's ``trace`` extension
(``*.send_request_headers.started``): before -> not sent; after -> a POST's outcome is unknown, a GET is
*abandoned* (:class:`RemoteAbandonedError`: the provider may still be serving it). With an injected transport
that does not report the trace, a deadline always counts as "after" (never re-send on a guess).

The ``httpx.AsyncClient`` is built in one factory, :func:`make_http_client`, so tests and benchmarks inject a
transport instead of patching. URLs, headers and timeouts of each kind of call are resolved against it once
(:class:`_Call`); with the default aiohttp transport the client calls it directly
(:meth:`streams.remote.transport.AiohttpTransport.send`), any other transport gets each request through
``AsyncClient.send``. Either way the same answers and the same httpx exceptions reach the classification.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import email.utils
import logging
import math
import re
import ssl
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import httpcore
import httpx
import yarl
from multidict import CIMultiDict

from streams import metrics
from streams.config import Settings
from streams.errors import (
    ConfigError,
    JsonValueError,
    RemoteAbandonedError,
    RemoteContractError,
    RemoteJobNotFoundError,
    RemoteNotSentError,
    RemoteRateLimitedError,
    RemoteRefusedError,
    RemoteTransientError,
    RemoteUnknownOutcomeError,
    RemoteUnknownStatusError,
    error_summary,
)
from streams.kafka_security import ssl_context
from streams.model.answers import JOB_ID, JobSnapshot, LookupJob, clean_text
from streams.model.codes import RemoteCallOutcome
from streams.remote.dialect import (
    CLIENT_HEADERS,
    DEFAULT_DIALECT,
    FieldPath,
    ProviderDialect,
    load_dialect,
    read_path,
    route_problem,
)
from streams.remote.redaction import without_request_echoes
from streams.remote.transport import (
    DEFAULT_ANSWER_MAX_BYTES,
    AiohttpTransport,
    AnswerTooLargeError,
    BoundedBody,
    client_timeout,
    make_response,
)
from streams.wire import contracts, exactjson, jsontext

log = logging.getLogger(__name__)

#: ``Retry-After`` delay-seconds: ASCII digits (RFC 9110, 10.2.3), a decimal fraction tolerated; any length.
_DELTA_SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?")

#: httpx exceptions raised before any byte of the request was written.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


#: The default of ``Settings.remote_call_deadline_s`` (seconds), for clients built without settings.
DEFAULT_CALL_DEADLINE_S: float = Settings.model_fields["remote_call_deadline_s"].default


class _SendProbe:
    """httpcore ``trace`` callback: records whether writing the request started (headers, HTTP/1.1 or 2)."""

    def __init__(self) -> None:
        self.sent = False

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event.endswith(".send_request_headers.started"):
            self.sent = True


class _PoolRepair:
    """Gives back the pool slots that httpcore 1.0.9 loses when a request is cancelled mid-way (upstream bug,
    open and unreleased; httpx 0.28 gets no more releases).

    httpcore's cleanup after a cancellation is not itself safe from an asyncio cancellation: a request cancelled
    after the pool assigned it a new connection but before it connected leaves that connection "connecting"
    forever (or HTTP/1.1 "NEW" when the cancellation falls between connecting and sending), and one cancelled
    while its answer is being closed stays listed as active with its connection. Neither is idle, closed nor
    available, so each holds a slot until every call fails with ``PoolTimeout`` against a healthy provider
    (reproduced in about one second of cancelled calls on a pool of 2; ``tests/integration/
    test_http_pool_storm.py``). Cancellations are routine in this worker: the call deadline, a lease lost
    during a GET, rebalances.

    :meth:`repair` runs (synchronously: nothing can interrupt it) after every call that did not return an answer:
    it removes the call's own request if the pool still lists it, then every connection that no listed request
    owns and that is neither idle nor closed (an orphan: with HTTP/1.1 a connection in use always belongs to a
    listed request), hands the freed slots to queued requests and closes the orphans in the background. It
    touches httpcore's private pool state, checked at start-up; without it, it does nothing.
    """

    _ATTRIBUTES = ("_requests", "_connections", "_optional_thread_lock", "_assign_requests_to_connections")

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        pool = getattr(transport, "_pool", None)  # httpx's own transport, or its proxy transport: httpcore's pool
        usable = isinstance(pool, httpcore.AsyncConnectionPool) and all(hasattr(pool, a) for a in self._ATTRIBUTES)
        self.pool: Any = pool if usable else None
        self._closing: set[asyncio.Future[None]] = set()

    def repair(self, probe: _SendProbe) -> int:
        """Free what the call traced by ``probe`` left behind; returns the orphaned connections reclaimed."""
        pool = self.pool
        if pool is None:
            return 0
        with pool._optional_thread_lock:
            for leftover in [r for r in pool._requests if r.request.extensions.get("trace") is probe]:
                pool._requests.remove(leftover)
            owned = {id(r.connection) for r in pool._requests if r.connection is not None}
            orphans = [c for c in pool._connections if id(c) not in owned and not c.is_idle() and not c.is_closed()]
            for connection in orphans:
                pool._connections.remove(connection)
            closing = orphans + pool._assign_requests_to_connections()
        if closing:
            task = asyncio.ensure_future(self._close(closing))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        if orphans:
            metrics.HTTP_POOL_REPAIRS.inc(len(orphans))
            log.info("HTTP pool: %d connection(s) orphaned by a cancelled call reclaimed", len(orphans))
        return len(orphans)

    @staticmethod
    async def _close(connections: list[Any]) -> None:
        for connection in connections:
            with contextlib.suppress(Exception):
                await connection.aclose()


class _DeadlineExceeded(Exception):
    """The overall deadline cut a call; ``sent`` tells whether the request may have reached the provider."""

    def __init__(self, deadline_s: float, sent: bool) -> None:
        super().__init__(f"no complete answer within the {deadline_s:g} s call deadline")
        self.sent = sent


def _path_segment(text: str) -> str:
    """``text`` as one percent-encoded path segment: every character but the unreserved ones encoded, and a
    segment of dots (``.``, ``..``) encoded too, so that no URL normalization can read it as a step up."""
    quoted = quote(text, safe="")
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted


class _Call:
    """One kind of request resolved once against the client (``http.build_request``): its method, absolute URL
    (text), headers (the client's merged with the call's; ``Content-Length`` left to the sender) and httpx
    timeouts. Building them per call costs httpx ~30 µs of URL parsing and header and cookie merging; a GET
    differs from the next only by the job id appended to :attr:`url`."""

    def __init__(self, request: httpx.Request) -> None:
        self.method = request.method
        self.url = str(request.url)
        self.headers = httpx.Headers([(k, v) for k, v in request.headers.multi_items() if k != "content-length"])
        self.fields: CIMultiDict[str] = CIMultiDict(self.headers.multi_items())  # the same, for aiohttp
        self.timeout: dict[str, float | None] = request.extensions.get("timeout", {})


def provider_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """TLS of the provider's client: the CA ``remote_ca_file`` and the client certificate
    ``remote_client_cert_file`` + ``remote_client_key_file``; None when neither is set (the system's CAs).

    Raises:
        ConfigError: a file cannot be read as PEM (the message names the variable).
    """
    if not (settings.remote_ca_file or settings.remote_client_cert_file):
        return None
    return ssl_context(
        settings.remote_ca_file,
        settings.remote_client_cert_file,
        settings.remote_client_key_file,
        check_hostname=True,
        what="STREAMS_REMOTE",
    )


def auth_header_of(settings: Settings, dialect: ProviderDialect) -> tuple[str, str]:
    """The auth header's name and scheme: ``STREAMS_REMOTE_AUTH_HEADER`` / ``_AUTH_SCHEME`` when set explicitly,
    else the declaration's (:mod:`streams.remote.dialect`)."""
    explicit = settings.model_fields_set
    header = settings.remote_auth_header if "remote_auth_header" in explicit else dialect.auth_header
    scheme = settings.remote_auth_scheme if "remote_auth_scheme" in explicit else dialect.auth_scheme
    return header, scheme


def make_http_client(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None, dialect: ProviderDialect | None = None
) -> httpx.AsyncClient:
    """The worker's single ``httpx.AsyncClient`` for the remote API.

    Timeouts (seconds) come from ``settings.http_*_timeout_s``; auth is ``<header>: <scheme> <key>`` with the
    header and scheme of :func:`auth_header_of` (default ``Authorization: Bearer <key>``; no scheme: the key alone);
    TLS from :func:`provider_ssl_context`. ``dialect`` defaults to ``settings.provider_dialect`` loaded.
    Requests go through ``transport`` when given (tests, benchmarks), else the one ``settings.http_transport``
    names: ``aiohttp`` (:class:`streams.remote.transport.AiohttpTransport`, whose exception mapping keeps the taxonomy
    above) or ``httpx`` (httpcore's pool); both hold at most ``settings.http_max_connections`` connections.
    """
    limits = httpx.Limits(
        max_connections=settings.http_max_connections,
        max_keepalive_connections=settings.http_max_connections,
    )
    context = provider_ssl_context(settings)
    if transport is None and settings.http_transport == "aiohttp":
        transport = AiohttpTransport(
            max_connections=settings.http_max_connections,
            ssl_context=context,
            max_answer_bytes=settings.remote_answer_max_bytes,
        )
    key = settings.remote_api_key.get_secret_value()
    header, scheme = auth_header_of(settings, dialect or load_dialect(settings.provider_dialect))
    return httpx.AsyncClient(
        base_url=settings.remote_base_url.get_secret_value(),
        headers={
            header: f"{scheme} {key}" if scheme else key,
            "User-Agent": "generation-streams/0.1",
        },
        verify=context if context is not None else True,
        timeout=httpx.Timeout(
            connect=settings.http_connect_timeout_s,
            read=settings.http_read_timeout_s,
            write=settings.http_write_timeout_s,
            pool=settings.http_pool_timeout_s,
        ),
        limits=limits,
        transport=transport,
    )


@dataclass(frozen=True)
class SubmitResult:
    """A POST that created a remote job.

    ``via_error`` is True when the job id came from an HTTP 502's ``error.job_id``.
    ``poll_after_s`` is the API's hint for the first GET, if it gave one.
    """

    job_id: str
    status_code: int
    via_error: bool
    poll_after_s: float | None
    duration_ms: float


@dataclass(frozen=True)
class CancelResult:
    """One call of the provider's cancel route: its classified ``outcome``, whether it is ``definite`` (the route
    is not called again for the job), the HTTP status (None: no answer), the duration and a short ``detail`` for
    the log (never the answer's payload)."""

    outcome: RemoteCallOutcome
    definite: bool
    status_code: int | None
    duration_ms: float
    detail: str


#: The provider's cancel route answered: outcome and whether it is definite, by HTTP status (others: below).
_CANCEL_ANSWERS: dict[int, tuple[RemoteCallOutcome, bool]] = {
    404: (RemoteCallOutcome.CANCEL_NOT_FOUND, False),
    409: (RemoteCallOutcome.CANCEL_ALREADY_TERMINAL, True),
    429: (RemoteCallOutcome.CANCEL_UNKNOWN_OUTCOME, False),
}


def classify_cancel_answer(status: int) -> tuple[RemoteCallOutcome, bool]:
    """The outcome of an answer of the cancel route with HTTP ``status`` and whether it is definite (module
    docstring): 2xx accepted, 409 already terminal, other 4xx refused (definite); 404 not found, 429 and anything
    else unknown (asked again)."""
    if 200 <= status < 300:
        return RemoteCallOutcome.CANCEL_ACCEPTED, True
    if status in _CANCEL_ANSWERS:
        return _CANCEL_ANSWERS[status]
    if 400 <= status < 500:
        return RemoteCallOutcome.CANCEL_REFUSED, True
    return RemoteCallOutcome.CANCEL_UNKNOWN_OUTCOME, False


#: The default of ``Settings.remote_cancel_path``.
DEFAULT_CANCEL_PATH: str = Settings.model_fields["remote_cancel_path"].default

#: Upper bound of any poll hint from the API (s): a broken or hostile hint cannot park a job for years.
MAX_POLL_HINT_S = 3600.0

#: Wait after a 429 whose ``Retry-After`` is absent or unreadable (s).
RATE_LIMITED_FALLBACK_S = 1.0

#: Latest time the ledger and the topic schemas accept (epoch ms of 9999-12-31T23:59:59.999Z).
MAX_EPOCH_MS = 253_402_300_799_999

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


#: Most seconds an HTTP-date ``Retry-After`` is taken for when the answer carries no usable ``Date`` (the worker's
#: own clock is then the reference, and a skewed clock must not turn a date into a long pause).
UNDATED_RETRY_AFTER_CAP_S = 60.0


def parse_retry_after_s(
    value: str | None,
    *,
    cap_s: float = MAX_POLL_HINT_S,
    now: dt.datetime | None = None,
    date: str | None = None,
) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (RFC 9110, 10.2.3), or None when absent or unreadable.

    * delay-seconds (ASCII digits, a decimal fraction tolerated, surrounding spaces ignored): that many
      seconds, capped at ``cap_s`` (``86400000`` -> ``cap_s``; a long number is read, not refused);
    * an HTTP-date: seconds from the answer's own ``Date`` header (``date``; RFC 9110 10.2.3: the two are on the
      server's clock) until then, 0 when it is past, capped. Without a readable ``Date`` the reference is ``now``
      (default: the worker's wall clock), and the result is also capped at :data:`UNDATED_RETRY_AFTER_CAP_S`;
    * anything else (``-1``, ``nan``, ``1e999``, ``inf``, empty): None, and the caller falls back to its own
      backoff. The result is never negative, never NaN and never above ``cap_s``.
    """
    if value is None:
        return None
    text = value.strip(" \t")
    if _DELTA_SECONDS.fullmatch(text):
        return min(cap_s, float(text))  # float() of a very long number is inf: capped like the rest
    when = _http_date(text)
    if when is None:
        return None
    sent = _http_date(date.strip(" \t")) if date is not None else None
    if sent is None:
        cap_s = min(cap_s, UNDATED_RETRY_AFTER_CAP_S)
    reference = sent or now or dt.datetime.now(dt.UTC)
    return min(cap_s, max(0.0, (when - reference).total_seconds()))


def _http_date(text: str) -> dt.datetime | None:
    """An HTTP-date (IMF-fixdate or the obsolete forms) as an aware UTC datetime, None when unreadable."""
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return when.replace(tzinfo=dt.UTC) if when.tzinfo is None else when  # an HTTP-date is always GMT


def retry_after_s(response: httpx.Response) -> float | None:
    """The answer's ``Retry-After`` in seconds, read against its own ``Date`` (:func:`parse_retry_after_s`)."""
    return parse_retry_after_s(response.headers.get("Retry-After"), date=response.headers.get("Date"))


def _read_json(response: httpx.Response) -> tuple[Any, JsonValueError | None]:
    """The answer's JSON with every number exact, or None and why it could not be read."""
    try:
        return exactjson.loads(response.content), None
    except JsonValueError as exc:
        return None, exc


def _poll_after_s(
    body: dict[str, Any] | None, response: httpx.Response, path: FieldPath = ("poll_after_ms",)
) -> float | None:
    """The API's poll hint in seconds: ``Retry-After`` when readable, else the milliseconds at ``path``
    (``poll_after_ms`` in the seed's dialect); clamped to ``[0, MAX_POLL_HINT_S]``; None when neither is usable."""
    hint = retry_after_s(response)
    if hint is not None:
        return hint
    value = read_path(body, path) if body is not None else None
    if not exactjson.is_number(value):
        return None
    try:
        seconds = float(value) / 1000.0  # a huge Decimal is inf here: capped below
    except OverflowError:  # an integer past a float's range (exact JSON keeps integers as int)
        seconds = math.inf if value > 0 else -math.inf
    return min(MAX_POLL_HINT_S, max(0.0, seconds)) if not math.isnan(seconds) else None


def read_completed_at_ms(value: Any) -> tuple[int | None, str | None]:
    """The remote ``completed_at`` as epoch milliseconds, or None and the reason it was not read.

    ================================================ =====================================================
    ``completed_at``                                 result
    ================================================ =====================================================
    absent or ``null``                               ``(None, None)``
    a number below 1e11                              unix seconds -> ms (sub-millisecond digits dropped)
    a larger number                                  epoch ms
    an RFC 3339 date-time with ``Z`` or ``±hh:mm``   that instant in epoch ms
    a date-time without an offset                    ``(None, reason)``: not guessed as UTC (an hours-wide
                                                     error would pass unseen)
    negative, after 9999-12-31, other text, a bool   ``(None, reason)``
    ================================================ =====================================================

    The caller records the reason with the observation (``completed_at_problem``) and logs it.
    """
    if value is None:
        return None, None
    ms: int | None = None
    if exactjson.is_number(value):
        number = value if isinstance(value, Decimal) else Decimal(repr(value) if isinstance(value, float) else value)
        if number.is_finite():
            ms = int(number * 1000) if number < Decimal("1e11") else int(number)
    elif isinstance(value, str):
        if not contracts.format_conforms(value, "date-time"):
            try:
                naive = "T" in value.upper() and dt.datetime.fromisoformat(value.upper()).tzinfo is None
            except ValueError:
                naive = False
            if naive:
                return None, f"completed_at {_shown(value)} has no UTC offset (RFC 3339 requires Z or +hh:mm); not read"
            return None, f"completed_at {_shown(value)} is not an RFC 3339 date-time; not read"
        try:
            when = dt.datetime.fromisoformat(value.upper())
        except ValueError as exc:  # e.g. a leap second: valid RFC 3339, not representable
            return None, f"completed_at {_shown(value)} cannot be represented ({exc}); not read"
        ms = (when - _EPOCH) // dt.timedelta(milliseconds=1)
    else:
        return None, f"completed_at {_shown(value)} is neither a number nor a date-time; not read"
    if ms is None or not 0 <= ms <= MAX_EPOCH_MS:
        return None, f"completed_at {_shown(value)} is outside 1970-01-01 .. 9999-12-31; not read"
    return ms, None


def _json_kind(value: Any) -> str:
    """The JSON kind of a parsed value, for a message that must not quote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "text"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "a number"


def _lookup_jobs_problem(data: Any, where: str, job_id_path: FieldPath) -> str | None:
    """What makes the jobs of a lookup answer unreadable (``where``: the declaration's jobs path), None when each
    is an object with a usable job id at the declaration's ``answer.job_id``. Describes, never quotes: the jobs of
    a provider's list may carry their inputs and outputs (user payload)."""
    if not isinstance(data, list):
        return f"at {where}: {_json_kind(data)}, not a list"
    for i, job in enumerate(data):
        if not isinstance(job, dict):
            return f"job {i} of {len(data)} is {_json_kind(job)}, not an object"
        job_id = read_path(job, job_id_path)
        if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
            return f"job {i} of {len(data)} has no usable id at {'.'.join(job_id_path)}"
    return None


def _shown(value: Any, limit: int = 80) -> str:
    """``value`` as short text for a reason (numbers exactly as they came: ``JsonDecimal`` shows its JSON)."""
    return clean_text(repr(value), limit)


def provider_request_body(
    request_text: str, operation_id: str, default_model: str, dialect: ProviderDialect | None = None
) -> bytes:
    """The POST body for one operation (UTF-8): the application's request text with every character kept,
    plus what the product adds (docs/guarantees.md, "Submissions"):

    * ``metadata.client_reference``: the operation id, so the provider's record of the job names the operation
      (an operator can find the job of an ``uncertain`` operation). It is NOT an idempotency key: nothing says
      the provider refuses a second job with the same reference; the product itself never re-sends a POST whose
      outcome is unknown.
    * ``model``: ``default_model`` (``STREAMS_REMOTE_MODEL``) when the request names none.

    The keys are the declaration's (``dialect``, default the seed's): ``request.model_field`` and
    ``request.reference_field`` (one key, or ``object.key``).

    ``request_text`` is a JSON object whose ``metadata``, if present, is an object without ``client_reference``
    (``schemas/generation.submissions.json`` guarantees both); numbers and strings are never re-encoded.
    """
    model_field, reference_path = (
        (dialect.model_field, dialect.reference_path) if dialect is not None else ("model", _SEED_REFERENCE)
    )
    found = jsontext.members(request_text)
    reference = exactjson.dumps(operation_id).decode()
    added: list[tuple[str, str]] = []
    if not any(m.key == model_field for m in found):
        added.append((model_field, exactjson.dumps(default_model).decode()))
    text = request_text
    if len(reference_path) == 1:
        added.append((reference_path[0], reference))
        return jsontext.append_members(text, added, empty=not found).encode()
    outer, inner_key = reference_path
    metadata = next((m for m in found if m.key == outer), None)
    if metadata is None:
        added.append((outer, "{" + exactjson.dumps(inner_key).decode() + ":" + reference + "}"))
    else:
        inner = jsontext.append_members(text[metadata.start : metadata.end], [(inner_key, reference)])
        text = text[: metadata.start] + inner + text[metadata.end :]
    return jsontext.append_members(text, added, empty=not found).encode()


#: Where the operation id goes in the seed's dialect.
_SEED_REFERENCE: FieldPath = ("metadata", "client_reference")


#: Characters of a raw answer's body kept (it is stored when an operation stalls).
RAW_ANSWER_CHARS = 4000


def raw_answer(response: httpx.Response) -> dict[str, Any]:
    """``{"http_status": int, "body": str}``: an answer kept as it came (body text, storable, truncated)."""
    return {"http_status": response.status_code, "body": clean_text(response.text, RAW_ANSWER_CHARS)}


class RemoteClient:
    """Calls the remote generation API for one worker; see the module docstring for the taxonomy.

    Args:
        http: the client from :func:`make_http_client` (owned by the caller, closed by :meth:`aclose`).
        model: the model name sent with each POST.
        call_deadline_s: overall deadline of one call, seconds (``Settings.remote_call_deadline_s``; the default
            is that setting's default: a worker builds its client with :meth:`from_settings`).
        traced: True when ``http`` uses httpx's own transport (httpcore), whose ``trace`` extension tells
            whether a request was sent when the deadline struck; False for injected transports.
        max_answer_bytes: most bytes of one answer's body read, decoded (``Settings.remote_answer_max_bytes``;
            the aiohttp transport enforces its own, set from the same setting by :func:`make_http_client`).
        throttled_codes: ``error.code`` values of a 4xx answer that mean "throttled" (a concurrency limit), read
            like a 429 (``Settings.remote_throttled_codes``).
        output_ttl_s: how long an output stays fetchable after completion when the answer does not say
            (``Settings.remote_output_ttl_s``; 0: unknown).
        cancel_path: the cancel route with ``{job_id}`` (None: the declaration's).
        dialect: the provider's API shape (:mod:`streams.remote.dialect`; None: the seed's): routes, create
            headers, where each answer field sits, the status words.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        model: str,
        *,
        call_deadline_s: float = DEFAULT_CALL_DEADLINE_S,
        traced: bool = False,
        max_answer_bytes: int = DEFAULT_ANSWER_MAX_BYTES,
        throttled_codes: frozenset[str] = frozenset(),
        output_ttl_s: float = 0.0,
        cancel_path: str | None = None,
        dialect: ProviderDialect | None = None,
    ) -> None:
        self.http = http
        self.dialect = dialect = dialect or load_dialect(DEFAULT_DIALECT)
        self.throttled_codes = throttled_codes
        self.output_ttl_s = output_ttl_s
        self.cancel_path = cancel_path if cancel_path is not None else dialect.cancel_path
        self.model = model
        self.call_deadline_s = call_deadline_s
        self.traced = traced
        self.max_answer_bytes = max_answer_bytes
        create_headers = {"Content-Type": "application/json", **dict(dialect.create_headers)}
        self._post = _Call(http.build_request(dialect.create_method, dialect.create_path, headers=create_headers))
        get_prefix, _, self._get_suffix = dialect.get_path.partition("{job_id}")
        self._get = _Call(http.build_request("GET", get_prefix))  # + the quoted job id + the suffix
        # The aiohttp transport is called directly (the client's auth, redirect, cookie and event-hook layers do
        # nothing here: no auth, no redirects followed, no cookies, no hooks); any other transport (httpcore, a
        # test's MockTransport) gets each request through ``http.send``. Chosen as httpx routes the base URL: a
        # client given a transport ignores proxies from the environment; without one (``http_transport=httpx``)
        # ``HTTP_PROXY`` routes to httpx's proxy transport, whose pool is then the one to repair.
        routed = http._transport_for_url(httpx.URL(self._post.url))
        self._aiohttp = routed if isinstance(routed, AiohttpTransport) else None
        self._pool_repair = _PoolRepair(routed)
        timeout = self._post.timeout
        self._client_timeout = client_timeout(timeout.get("connect"), timeout.get("read"), timeout.get("pool"))

    @classmethod
    def from_settings(cls, settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> RemoteClient:
        """The worker's client: :func:`make_http_client` plus the settings' model, call deadline and provider
        dialect (``STREAMS_REMOTE_CANCEL_PATH``, when set, overrides the declaration's cancel route).

        Raises:
            ConfigError: ``STREAMS_PROVIDER_DIALECT`` names no readable, valid declaration, or one whose
                ``Prefer: wait`` is not shorter than the read timeout and the call deadline, or one without a lookup
                while ``STREAMS_LOOKUP_ENABLED`` is on; ``STREAMS_REMOTE_AUTH_HEADER`` names a header the client
                sets itself (:data:`~streams.remote.dialect.CLIENT_HEADERS`).
        """
        dialect = load_dialect(settings.provider_dialect)
        wait_s = dialect.prefer_wait_s()
        if wait_s is not None and wait_s >= min(settings.http_read_timeout_s, settings.remote_call_deadline_s):
            raise ConfigError(
                f"STREAMS_PROVIDER_DIALECT: {dialect.source} asks the provider to hold each create answer up to "
                f"{wait_s:g} s (Prefer: wait), not less than STREAMS_HTTP_READ_TIMEOUT_S "
                f"({settings.http_read_timeout_s:g}) or STREAMS_REMOTE_CALL_DEADLINE_S "
                f"({settings.remote_call_deadline_s:g}): every POST would end uncertain; raise them or lower the wait"
            )
        if settings.lookup_enabled and dialect.lookup is None:
            raise ConfigError(
                f"STREAMS_LOOKUP_ENABLED is on but the provider dialect {dialect.source} declares no lookup by "
                "client reference (lookup: null): turn it off; its uncertain operations then wait for an "
                "operator's decision (streams operations adopt/abandon, docs/decisions.md)"
            )
        if "remote_auth_header" in settings.model_fields_set and settings.remote_auth_header.lower() in CLIENT_HEADERS:
            raise ConfigError(
                f"STREAMS_REMOTE_AUTH_HEADER is {settings.remote_auth_header!r}: a header the client sets itself "
                "cannot carry the API key; name the provider's auth header (e.g. Authorization)"
            )
        explicit_cancel = "remote_cancel_path" in settings.model_fields_set
        if explicit_cancel and settings.remote_cancel_path.count("{job_id}") != 1:
            raise ConfigError(
                f"STREAMS_REMOTE_CANCEL_PATH is {settings.remote_cancel_path!r}: it must hold {{job_id}} once"
            )
        problem = route_problem(settings.remote_cancel_path) if explicit_cancel else None
        if problem is not None:  # the declaration's routes are checked as it loads (streams.remote.dialect)
            raise ConfigError(f"STREAMS_REMOTE_CANCEL_PATH is {settings.remote_cancel_path!r}: {problem}")
        return cls(
            make_http_client(settings, transport, dialect),
            settings.remote_model,
            call_deadline_s=settings.remote_call_deadline_s,
            traced=transport is None,
            max_answer_bytes=settings.remote_answer_max_bytes,
            throttled_codes=settings.remote_throttled_code_set,
            output_ttl_s=settings.remote_output_ttl_s,
            cancel_path=settings.remote_cancel_path if explicit_cancel else None,
            dialect=dialect,
        )

    async def aclose(self) -> None:
        """Close the underlying HTTP client."""
        await self.http.aclose()

    async def _request(self, call: _Call, url: str, body: bytes | None = None) -> httpx.Response:
        """``call`` to ``url`` (absolute, encoded) with ``body``, within :attr:`call_deadline_s`, the whole answer
        read.

        Raises:
            _DeadlineExceeded: the deadline struck (``sent`` as far as can be told; True when unknown).
            httpx.HTTPError, httpx.InvalidURL: as httpx (or the aiohttp transport, mapped) raised them.
        """
        probe = _SendProbe()
        deadline = asyncio.timeout(self.call_deadline_s)
        try:
            async with deadline:
                if self._aiohttp is not None:
                    target = yarl.URL(url, encoded=True)
                    return await self._aiohttp.send(call.method, target, call.fields, body, self._client_timeout, probe)
                request = httpx.Request(
                    call.method,
                    url,
                    headers=call.headers,
                    content=body,
                    extensions={"timeout": call.timeout, "trace": probe},
                )
                return await self._read_bounded(await self.http.send(request, stream=True), request)
        except TimeoutError as exc:
            self._pool_repair.repair(probe)
            if not deadline.expired():
                raise
            raise _DeadlineExceeded(self.call_deadline_s, probe.sent or not self.traced) from exc
        except BaseException:  # cancelled, or an httpx error: give back what the pool may have lost
            self._pool_repair.repair(probe)
            raise

    async def _read_bounded(self, response: httpx.Response, request: httpx.Request) -> httpx.Response:
        """``response`` (streamed, from a transport other than aiohttp) read and decoded within
        :attr:`max_answer_bytes`, then closed.

        Raises:
            AnswerTooLargeError, httpx.DecodingError: as :class:`BoundedBody`; httpx's read errors.
        """
        try:
            reader = BoundedBody(response.headers.get_list("content-encoding"), self.max_answer_bytes, request)
            if hasattr(response, "_content"):  # an in-memory answer (a test's MockTransport): already decoded
                if len(response.content) > self.max_answer_bytes:
                    raise AnswerTooLargeError(self.max_answer_bytes, f"{len(response.content)} bytes", request)
                return response
            length = response.headers.get("content-length")
            reader.check_length(int(length) if length is not None and length.strip().isdigit() else None)
            content = await reader.read(response.aiter_raw())
        finally:
            await response.aclose()
        reason = response.extensions.get("reason_phrase", b"").decode("ascii", "replace") or None
        return make_response(response.status_code, reason, response.headers.raw, content, request)

    async def submit(self, operation_id: str, request_text: str) -> SubmitResult:
        """POST one generation; returns the created job or raises a classified :class:`RemoteError`.

        ``request_text`` is the provider's request body as JSON text (an object); it is sent as
        :func:`provider_request_body` makes it: unchanged but for ``metadata.client_reference`` and a default
        ``model``.

        Raises:
            RemoteRateLimitedError: 429, nothing created; retry after ``retry_after_s``.
            RemoteRefusedError: other 4xx, nothing created.
            RemoteNotSentError: no byte was sent; safe to retry.
            RemoteUnknownOutcomeError: sent and outcome unknown (an answer that could not be read too); never
                retry.
        """
        body = provider_request_body(request_text, operation_id, self.model, self.dialect)
        started = time.perf_counter()
        try:
            response = await self._request(self._post, self._post.url, body)
        except _DeadlineExceeded as exc:
            if not exc.sent:
                raise RemoteNotSentError(operation_id, f"POST not sent: {exc}") from exc
            why = f"POST timed out after send ({exc}); a job may exist"
            raise RemoteUnknownOutcomeError(operation_id, why) from exc
        except _NOT_SENT as exc:
            raise RemoteNotSentError(operation_id, f"POST not sent ({error_summary(exc)})") from exc
        except httpx.TimeoutException as exc:
            raise RemoteUnknownOutcomeError(
                operation_id, f"POST timed out after send ({type(exc).__name__}); a job may exist"
            ) from exc
        except httpx.TransportError as exc:
            raise RemoteUnknownOutcomeError(
                operation_id, f"connection lost after send ({error_summary(exc)}); a job may exist"
            ) from exc
        except httpx.HTTPError as exc:  # answered, but the answer could not be read (DecodingError: a bad gzip)
            raise RemoteUnknownOutcomeError(
                operation_id, f"POST answer could not be read ({error_summary(exc)}); a job may exist"
            ) from exc
        duration_ms = (time.perf_counter() - started) * 1000.0
        return self._classify_submit(operation_id, response, duration_ms, request_text)

    def _classify_submit(
        self, operation_id: str, response: httpx.Response, duration_ms: float, request_text: str
    ) -> SubmitResult:
        """The POST's answer read (see :meth:`submit`); a refusal's message without what it quotes of
        ``request_text`` (:func:`~streams.remote.redaction.without_request_echoes`)."""
        status = response.status_code
        fields = self.dialect.answer
        parsed, unreadable = _read_json(response)
        body = parsed if isinstance(parsed, dict) else None
        # An answer that cannot be read exactly (NaN, a number too long, not JSON) is not trusted in part.
        why_unreadable = f" (body not read: {clean_text(str(unreadable), 300)})" if unreadable is not None else ""
        if 200 <= status < 300:
            job_id = read_path(body, fields.job_id)
            if isinstance(job_id, str) and JOB_ID.fullmatch(job_id):
                return SubmitResult(
                    job_id, status, False, _poll_after_s(body, response, fields.poll_after_ms), duration_ms
                )
            raise RemoteUnknownOutcomeError(
                operation_id,
                f"HTTP {status} without a usable job id ({_shown(job_id)}){why_unreadable}; a job may exist",
                status_code=status,
            )
        error_job_id = read_path(body, fields.error_job_id)
        if status == 502 and isinstance(error_job_id, str) and JOB_ID.fullmatch(error_job_id):
            return SubmitResult(
                error_job_id, status, True, _poll_after_s(body, response, fields.poll_after_ms), duration_ms
            )
        if status == 429:
            retry_after = retry_after_s(response)
            raise RemoteRateLimitedError(operation_id, RATE_LIMITED_FALLBACK_S if retry_after is None else retry_after)
        if 400 <= status < 500:
            raw_code, raw_message = read_path(body, fields.error_code), read_path(body, fields.error_message)
            code = clean_text(
                without_request_echoes(str(f"http_{status}" if raw_code is None else raw_code), request_text), 80
            )
            if code in self.throttled_codes:
                raise throttled(operation_id, response, code)
            message = str(response.reason_phrase if raw_message is None else raw_message)
            message = clean_text(without_request_echoes(message, request_text), 500)
            raise RemoteRefusedError(
                operation_id, f"refused with HTTP {status} {code}: {message}", status_code=status, code=code
            )
        raise RemoteUnknownOutcomeError(
            operation_id, f"HTTP {status} without error.job_id{why_unreadable}; a job may exist", status_code=status
        )

    async def observe(self, operation_id: str, job_id: str) -> JobSnapshot:
        """GET one remote job.

        Raises:
            RemoteJobNotFoundError: 404 for this job id (with the raw answer).
            RemoteUnknownStatusError: a 200 whose ``status`` is missing, not a string, or not a known word
                (with the raw answer).
            RemoteContractError: a 200 whose outputs break the contract (ids missing, not strings, repeated), or
                with a value that cannot be carried exactly (``NaN``, ``Infinity``, a number too long), naming it.
            RemoteRateLimitedError: 429 (retry after its hint).
            RemoteAbandonedError: cut off after the request was sent (deadline, timeout, connection lost): the
                provider may still be serving it.
            RemoteTransientError: any other failure (not sent, 5xx, a body that is not JSON, a 200 whose ``id``
                names another job).
        """
        started = time.perf_counter()
        try:
            response = await self._request(self._get, self._get.url + _path_segment(job_id) + self._get_suffix)
        except _DeadlineExceeded as exc:
            if exc.sent:
                raise RemoteAbandonedError(operation_id, f"GET {job_id} abandoned: {exc}") from exc
            raise RemoteTransientError(operation_id, f"GET {job_id} not sent: {exc}") from exc
        except _NOT_SENT as exc:
            raise RemoteTransientError(operation_id, f"GET {job_id} not sent ({error_summary(exc)})") from exc
        except httpx.TransportError as exc:
            raise RemoteAbandonedError(
                operation_id, f"GET {job_id} abandoned after send ({error_summary(exc)})"
            ) from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise RemoteTransientError(operation_id, f"GET {job_id} failed ({error_summary(exc)})") from exc
        duration_ms = (time.perf_counter() - started) * 1000.0
        return parse_job_answer(
            operation_id, job_id, response, duration_ms, self.throttled_codes, self.output_ttl_s, self.dialect
        )

    async def cancel(self, operation_id: str, job_id: str) -> CancelResult:
        """Ask the provider to cancel ``job_id`` (the declaration's cancel method, ``POST`` in both shipped ones, to
        :attr:`cancel_path` with the quoted job id, body ``{}``); never raises a classified failure: the answer is a
        :class:`CancelResult` (module docstring)."""
        call = _Call(
            self.http.build_request(
                self.dialect.cancel_method,
                self.cancel_path.replace("{job_id}", _path_segment(job_id)),
                headers={"Content-Type": "application/json"},
            )
        )
        started = time.perf_counter()
        try:
            response = await self._request(call, call.url, b"{}")
        except (_DeadlineExceeded, httpx.HTTPError, httpx.InvalidURL) as exc:
            duration_ms = (time.perf_counter() - started) * 1000.0
            detail = clean_text(f"cancel of {job_id} failed ({error_summary(exc)})", 300)
            return CancelResult(RemoteCallOutcome.CANCEL_UNKNOWN_OUTCOME, False, None, duration_ms, detail)
        duration_ms = (time.perf_counter() - started) * 1000.0
        outcome, definite = classify_cancel_answer(response.status_code)
        detail = f"cancel of {job_id} answered HTTP {response.status_code}"
        return CancelResult(outcome, definite, response.status_code, duration_ms, detail)

    async def lookup(self, operation_id: str) -> list[LookupJob]:
        """The jobs the provider lists for client reference ``operation_id`` (the declaration's ``lookup``: in the
        seed's dialect ``GET /v1/generations?client_reference=...``, the jobs at ``data``), each read with the
        declaration's ``answer.job_id``, ``status`` and ``created_at``; oldest first (by creation time, then id).

        Raises:
            ConfigError: the declaration has no lookup (``lookup: null``; :meth:`from_settings` refuses
                ``lookup_enabled`` with it, so only a client built otherwise gets here).
            RemoteRateLimitedError: 429 (retry after its hint).
            RemoteRefusedError: another 4xx: the provider does not offer the lookup (turn it off) or refused it.
            RemoteContractError: a 200 whose jobs are not a list of objects with usable job ids.
            RemoteTransientError: any other failure (the call deadline, timeouts, I/O, 5xx, unreadable body).
        """
        route = self.dialect.lookup
        if route is None:
            raise ConfigError(
                f"lookup of operation {operation_id}: the provider dialect {self.dialect.source} declares no lookup "
                "by client reference; turn STREAMS_LOOKUP_ENABLED off (uncertain operations wait for an operator)"
            )
        fields = self.dialect.answer
        try:
            call = _Call(self.http.build_request("GET", route.path, params={route.reference_param: operation_id}))
            response = await self._request(call, call.url)
        except (_DeadlineExceeded, httpx.HTTPError, httpx.InvalidURL) as exc:
            raise RemoteTransientError(operation_id, f"lookup failed ({error_summary(exc)})") from exc
        status = response.status_code
        body, _ = _read_json(response)
        body = body if isinstance(body, dict) else None
        if status == 429:
            retry_after = retry_after_s(response)
            raise RemoteRateLimitedError(operation_id, RATE_LIMITED_FALLBACK_S if retry_after is None else retry_after)
        if 400 <= status < 500:
            error = body.get("error") if body is not None else None
            code = (
                clean_text(str(error.get("code", f"http_{status}")), 80)
                if isinstance(error, dict)
                else f"http_{status}"
            )
            raise RemoteRefusedError(
                operation_id,
                f"lookup by client reference refused with HTTP {status} {code}; does the provider offer it?",
                status_code=status,
                code=code,
            )
        if status != 200 or body is None:
            raise RemoteTransientError(operation_id, f"lookup answered HTTP {status}", status_code=status)
        data = read_path(body, route.jobs)
        why = _lookup_jobs_problem(data, ".".join(route.jobs), fields.job_id)
        if why is not None:
            raise RemoteContractError(
                operation_id, f"lookup answer without a list of jobs with usable ids: {why}", status_code=status
            )
        jobs = []
        for j in data:
            status = read_path(j, fields.status)
            jobs.append(
                LookupJob(
                    job_id=read_path(j, fields.job_id),
                    status=clean_text(status, 80) if isinstance(status, str) else None,
                    created_at_ms=read_completed_at_ms(read_path(j, fields.created_at))[0],
                )
            )
        return sorted(jobs, key=lambda j: (j.created_at_ms is None, j.created_at_ms or 0, j.job_id))


def throttled(operation_id: str, response: httpx.Response, code: str) -> RemoteRateLimitedError:
    """A 4xx answer whose ``error.code`` ``code`` means "throttled", read like a 429: retry after its
    ``Retry-After`` (:data:`RATE_LIMITED_FALLBACK_S` without a readable one)."""
    retry_after = retry_after_s(response)
    wait_s = RATE_LIMITED_FALLBACK_S if retry_after is None else retry_after
    return RemoteRateLimitedError(operation_id, wait_s, status_code=response.status_code, code=code)


def _error_code(response: httpx.Response, path: FieldPath = ("error", "code")) -> str | None:
    """The answer's error code (at ``path``: ``error.code`` in the seed's dialect) as text, None when it has none."""
    body, _ = _read_json(response)
    code = read_path(body, path)
    return clean_text(str(code), 80) if code is not None else None


def parse_job_answer(
    operation_id: str,
    job_id: str,
    response: httpx.Response,
    duration_ms: float,
    throttled_codes: frozenset[str] = frozenset(),
    output_ttl_s: float = 0.0,
    dialect: ProviderDialect | None = None,
) -> JobSnapshot:
    """Classify one answer to the GET of a job (see :meth:`RemoteClient.observe`); a 4xx whose error code is in
    ``throttled_codes`` is read like a 429. Each output's expiry is read by :func:`output_expiries_ms`
    (``output_ttl_s``: the default after completion, 0 = none).

    Fields are read where ``dialect`` (default: the seed's, ``id``, ``status``, ``outputs``, ...) declares them,
    the status word mapped by its ``statuses``. With ``outputs_shape`` ``values`` the outputs (a list, or one
    value) become ``{"id": "output_<i>", "value": <value>}``; an error that is text becomes ``{"message": text}``.

    Every number of the answer is read exactly (:mod:`streams.wire.exactjson`): outputs carry big integers and long
    fractions unchanged. A 200 with ``NaN``/``Infinity`` or a number too long to carry is a contract violation
    naming the field; a 200 that is not JSON at all is retried, with what was wrong in the reason.

    Raises:
        RemoteJobNotFoundError, RemoteUnknownStatusError, RemoteRateLimitedError, RemoteContractError,
        RemoteTransientError.
    """
    status = response.status_code
    if status == 404:
        raise RemoteJobNotFoundError(operation_id, f"remote job {job_id} not found (404)", answer=raw_answer(response))
    if status == 429:
        retry_after = retry_after_s(response)
        raise RemoteRateLimitedError(operation_id, RATE_LIMITED_FALLBACK_S if retry_after is None else retry_after)
    dialect = dialect or load_dialect(DEFAULT_DIALECT)
    fields = dialect.answer
    if throttled_codes and 400 <= status < 500:
        code = _error_code(response, fields.error_code)
        if code is not None and code in throttled_codes:
            raise throttled(operation_id, response, code)
    if status != 200:
        raise RemoteTransientError(operation_id, f"GET {job_id} answered HTTP {status}", status_code=status)
    body, unreadable = _read_json(response)
    if unreadable is not None and unreadable.path is not None:
        raise RemoteContractError(
            operation_id,
            f"GET {job_id} answered HTTP 200 with a value that cannot be carried exactly: "
            f"{clean_text(str(unreadable), 300)}",
            status_code=status,
        )
    if not isinstance(body, dict):
        what = clean_text(str(unreadable), 300) if unreadable is not None else "JSON that is not an object"
        raise RemoteTransientError(operation_id, f"GET {job_id} answered HTTP 200 with {what}", status_code=status)
    answered_for = read_path(body, fields.job_id)
    if answered_for is not None and answered_for != job_id:  # another request's answer (a mixed-up connection)
        raise RemoteTransientError(
            operation_id, f"GET {job_id} answered HTTP 200 for another job ({_shown(answered_for)}); not read"
        )
    raw_status = read_path(body, fields.status)
    state = dialect.state_for(raw_status) if isinstance(raw_status, str) else None
    if state is None:
        raise RemoteUnknownStatusError(
            operation_id,
            f"GET {job_id} returned unknown status {clean_text(repr(raw_status), 80)}",
            answer=raw_answer(response),
        )
    remote_status = str(raw_status)
    outputs = read_path(body, fields.outputs)
    if fields.outputs_shape == "values":
        outputs = (
            []
            if outputs is None
            else [
                {"id": f"output_{i}", "value": v}
                for i, v in enumerate(outputs if isinstance(outputs, list) else [outputs])
            ]
        )
    outputs = outputs or []
    ids = (
        [o.get("id") for o in outputs]
        if isinstance(outputs, list) and all(isinstance(o, dict) for o in outputs)
        else None
    )
    if ids is None or not all(isinstance(i, str) and i for i in ids) or len(set(ids)) != len(ids):
        # The outputs are the application's payload: the message says what is wrong with them, never what they hold.
        if ids is None:
            why = "not a list of objects" if not isinstance(outputs, list) else "an output that is not an object"
        elif not all(isinstance(i, str) and i for i in ids):
            why = "an output whose id is missing or not text"
        else:
            why = "an id repeated"
        count = len(outputs) if isinstance(outputs, list) else 1
        raise RemoteContractError(
            operation_id,
            f"GET {job_id} returned outputs without distinct string ids ({count} output(s): {why})",
            status_code=status,
        )
    error = read_path(body, fields.error)
    if isinstance(error, str):
        error = {"message": clean_text(error, 500)}
    charge, refund = read_path(body, fields.charge), read_path(body, fields.refund)
    completed_at_ms, completed_at_problem = read_completed_at_ms(read_path(body, fields.completed_at))
    if completed_at_problem is not None:
        log.warning("GET %s: %s", job_id, completed_at_problem, extra={"operation_id": operation_id})
    return JobSnapshot(
        job_id=job_id,
        status=remote_status,
        state=state,
        outputs=outputs,
        poll_after_s=_poll_after_s(body, response, fields.poll_after_ms),
        completed_at_ms=completed_at_ms,
        completed_at_problem=completed_at_problem,
        error=error if isinstance(error, dict) else None,
        status_code=status,
        duration_ms=duration_ms,
        charge=charge if isinstance(charge, dict) else None,
        refund=refund if isinstance(refund, dict) else None,
        output_expires_at_ms=output_expiries_ms(
            operation_id, body, outputs, completed_at_ms, output_ttl_s, fields.expires_at
        ),
    )


def output_expiries_ms(
    operation_id: str,
    body: dict[str, Any],
    outputs: list[dict[str, Any]],
    completed_at_ms: int | None,
    output_ttl_s: float,
    path: FieldPath = ("expires_at",),
) -> tuple[int | None, ...]:
    """When each output stops being fetchable (epoch ms): the output's ``expires_at`` (the last key of ``path``,
    the declared field; ``()``: none), else the answer's (at ``path``), read like
    ``completed_at`` (:func:`read_completed_at_ms`: unix seconds or ms, or an RFC 3339 date-time); else
    ``completed_at_ms`` (the worker's clock when absent) + ``output_ttl_s`` when that is above 0; else None. An
    unreadable ``expires_at`` is logged and counts as absent."""
    default_ms: int | None = None
    if output_ttl_s > 0:
        default_ms = (completed_at_ms or int(time.time() * 1000)) + round(output_ttl_s * 1000)
    if not path:
        return tuple(default_ms for _ in outputs)
    job_ms = _expiry_ms(operation_id, read_path(body, path))
    key = path[-1]
    return tuple(_expiry_ms(operation_id, o.get(key)) or job_ms or default_ms for o in outputs)


def _expiry_ms(operation_id: str, value: Any) -> int | None:
    ms, problem = read_completed_at_ms(value)
    if problem is not None:
        log.warning("expires_at %s", problem.removeprefix("completed_at "), extra={"operation_id": operation_id})
    return ms
