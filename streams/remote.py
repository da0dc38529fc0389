"""The remote generation API client: one place for timeouts, auth, status mapping and error taxonomy.

Classification (ARCHITECTURE.md, "Contracts at the edges"):

=============================================== ================================== =====================
what happened                                   result                             POST retried?
=============================================== ================================== =====================
2xx with ``id``                                 :class:`SubmitResult` (created)    --
502 with ``error.job_id``                       :class:`SubmitResult` (created)    --
429                                             :class:`RemoteRateLimitedError`    yes, after Retry-After
other 4xx (400, 401, 403, 409, 422, ...)        :class:`RemoteRefusedError`        no (ends ``rejected``)
connection refused / not established / no       :class:`RemoteNotSentError`        yes (nothing was sent)
pooled connection free (no byte sent)
timeout or connection lost after send, 5xx      :class:`RemoteUnknownOutcomeError` no (ends ``uncertain``)
without job id, 2xx without a readable id
=============================================== ================================== =====================

The ``httpx.AsyncClient`` is built in one factory, :func:`make_http_client`, so tests and benchmarks inject a
transport instead of patching.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from streams.config import Settings
from streams.errors import (
    RemoteContractError,
    RemoteJobNotFoundError,
    RemoteNotSentError,
    RemoteRateLimitedError,
    RemoteRefusedError,
    RemoteTransientError,
    RemoteUnknownOutcomeError,
)
from streams.states import OperationState, state_for_remote_status

_DELTA_SECONDS = re.compile(r"\d{1,10}(\.\d{1,6})?")

#: httpx exceptions raised before any byte of the request was written.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


def make_http_client(settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The worker's single ``httpx.AsyncClient`` for the remote API.

    Timeouts (seconds) come from ``settings.http_*_timeout_s``; auth is ``Authorization: Bearer <key>``.
    ``transport`` replaces httpx's default pool (tests, alternative transports).
    """
    return httpx.AsyncClient(
        base_url=settings.remote_base_url,
        headers={"Authorization": f"Bearer {settings.remote_api_key}", "User-Agent": "generation-streams/0.1"},
        timeout=httpx.Timeout(
            connect=settings.http_connect_timeout_s,
            read=settings.http_read_timeout_s,
            write=settings.http_write_timeout_s,
            pool=settings.http_pool_timeout_s,
        ),
        limits=httpx.Limits(
            max_connections=settings.http_max_connections,
            max_keepalive_connections=settings.http_max_connections,
        ),
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
class JobSnapshot:
    """One GET of a remote job.

    ``state`` is the operation state the remote ``status`` maps to; ``outputs`` is a list of dicts with at
    least an ``id``; ``completed_at_ms`` is the remote completion time (epoch ms) when terminal.
    """

    job_id: str
    status: str
    state: OperationState
    outputs: list[dict[str, Any]] = field(default_factory=list)
    poll_after_s: float | None = None
    completed_at_ms: int | None = None
    error: dict[str, Any] | None = None
    status_code: int = 200
    duration_ms: float = 0.0

    def as_observation(self) -> dict[str, Any]:
        """The JSON saved as the operation's ``last_observation``."""
        return {
            "job_id": self.job_id,
            "status": self.status,
            "outputs": len(self.outputs),
            "completed_at_ms": self.completed_at_ms,
            "error": self.error,
        }


def parse_retry_after_s(value: str | None, *, cap_s: float = 3600.0) -> float | None:
    """Seconds from a ``Retry-After`` header, or None when absent or unreadable (RFC 9110, 10.2.3).

    Accepts delta-seconds (digits, a decimal fraction tolerated) and an HTTP-date; the result is clamped to
    ``[0, cap_s]`` so a hostile or broken header cannot stall a worker.
    """
    if value is None:
        return None
    text = value.strip()
    if _DELTA_SECONDS.fullmatch(text):
        return min(cap_s, float(text))
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return min(cap_s, max(0.0, (when - dt.datetime.now(dt.UTC)).total_seconds()))


def _json_or_none(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


#: Upper bound of any poll hint from the API (s): a broken or hostile hint cannot park a job for years.
MAX_POLL_HINT_S = 3600.0

#: Job ids this client accepts: they go into a URL path and the ledger (at most 256 characters).
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,255}")


def _poll_after_s(body: dict[str, Any] | None, response: httpx.Response) -> float | None:
    hint = parse_retry_after_s(response.headers.get("Retry-After"))
    if hint is not None:
        return hint
    value = body.get("poll_after_ms") if body is not None else None
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return min(MAX_POLL_HINT_S, max(0.0, float(value) / 1000.0))
    return None


def _to_ms(value: Any) -> int | None:
    """Epoch milliseconds from a unix time in seconds (or already in ms); None when absent or implausible."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        return None
    ms = int(value * 1000) if value < 1e11 else int(value)
    return ms if ms < 10**13 else None  # beyond the year 2286: not a real completion time


def clean_text(text: str, limit: int = 2000) -> str:
    """``text`` made storable in PostgreSQL text/jsonb (no NUL) and at most ``limit`` characters."""
    return text.replace("\x00", "\\0")[:limit]


class RemoteClient:
    """Calls the remote generation API for one worker; see the module docstring for the taxonomy.

    Args:
        http: the client from :func:`make_http_client` (owned by the caller, closed by :meth:`aclose`).
        model: the model name sent with each POST.
    """

    def __init__(self, http: httpx.AsyncClient, model: str) -> None:
        self.http = http
        self.model = model

    async def aclose(self) -> None:
        """Close the underlying HTTP client."""
        await self.http.aclose()

    async def submit(self, operation_id: str, request: dict[str, Any]) -> SubmitResult:
        """POST one generation; returns the created job or raises a classified :class:`RemoteError`.

        ``request`` holds ``context_tokens`` and ``generated_tokens`` (ints) and optionally ``model``.

        Raises:
            RemoteRateLimitedError: 429, nothing created; retry after ``retry_after_s``.
            RemoteRefusedError: other 4xx, nothing created.
            RemoteNotSentError: no byte was sent; safe to retry.
            RemoteUnknownOutcomeError: sent and outcome unknown; never retry.
        """
        body = {
            "model": request.get("model", self.model),
            "input": {
                "context_tokens": request["context_tokens"],
                "generated_tokens": request["generated_tokens"],
            },
            "metadata": {"operation_id": operation_id},
        }
        started = time.perf_counter()
        try:
            response = await self.http.post(
                "/v1/generations", content=orjson.dumps(body), headers={"Content-Type": "application/json"}
            )
        except _NOT_SENT as exc:
            raise RemoteNotSentError(operation_id, f"POST not sent ({type(exc).__name__}: {exc})") from exc
        except httpx.TimeoutException as exc:
            raise RemoteUnknownOutcomeError(
                operation_id, f"POST timed out after send ({type(exc).__name__}); a job may exist"
            ) from exc
        except httpx.TransportError as exc:
            raise RemoteUnknownOutcomeError(
                operation_id, f"connection lost after send ({type(exc).__name__}: {exc}); a job may exist"
            ) from exc
        duration_ms = (time.perf_counter() - started) * 1000.0
        return self._classify_submit(operation_id, response, duration_ms)

    def _classify_submit(self, operation_id: str, response: httpx.Response, duration_ms: float) -> SubmitResult:
        status = response.status_code
        body = _json_or_none(response)
        error = body.get("error") if body is not None else None
        error = error if isinstance(error, dict) else {}
        if 200 <= status < 300:
            job_id = body.get("id") if body is not None else None
            if isinstance(job_id, str) and JOB_ID.fullmatch(job_id):
                return SubmitResult(job_id, status, False, _poll_after_s(body, response), duration_ms)
            raise RemoteUnknownOutcomeError(
                operation_id,
                f"HTTP {status} without a usable job id ({clean_text(repr(job_id), 80)}); a job may exist",
                status_code=status,
            )
        if status == 502 and isinstance(error.get("job_id"), str) and JOB_ID.fullmatch(error["job_id"]):
            return SubmitResult(error["job_id"], status, True, _poll_after_s(body, response), duration_ms)
        if status == 429:
            retry_after = parse_retry_after_s(response.headers.get("Retry-After"))
            raise RemoteRateLimitedError(operation_id, 1.0 if retry_after is None else retry_after)
        if 400 <= status < 500:
            code = clean_text(str(error.get("code", f"http_{status}")), 80)
            message = clean_text(str(error.get("message", response.reason_phrase)), 500)
            raise RemoteRefusedError(
                operation_id, f"refused with HTTP {status} {code}: {message}", status_code=status, code=code
            )
        raise RemoteUnknownOutcomeError(
            operation_id, f"HTTP {status} without error.job_id; a job may exist", status_code=status
        )

    async def observe(self, operation_id: str, job_id: str) -> JobSnapshot:
        """GET one remote job.

        Raises:
            RemoteJobNotFoundError: 404 for this job id.
            RemoteContractError: a 200 whose outputs break the contract (ids missing, not strings, repeated).
            RemoteRateLimitedError: 429 (retry after its hint).
            RemoteTransientError: any other failure (timeouts, I/O, 5xx, unreadable body, unknown status).
        """
        started = time.perf_counter()
        try:
            response = await self.http.get(f"/v1/generations/{quote(job_id, safe='')}")
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise RemoteTransientError(operation_id, f"GET {job_id} failed ({type(exc).__name__}: {exc})") from exc
        duration_ms = (time.perf_counter() - started) * 1000.0
        status = response.status_code
        body = _json_or_none(response)
        if status == 404:
            raise RemoteJobNotFoundError(operation_id, f"remote job {job_id} not found (404)", status_code=404)
        if status == 429:
            retry_after = parse_retry_after_s(response.headers.get("Retry-After"))
            raise RemoteRateLimitedError(operation_id, 1.0 if retry_after is None else retry_after)
        if status != 200 or body is None:
            raise RemoteTransientError(operation_id, f"GET {job_id} answered HTTP {status}", status_code=status)
        remote_status = str(body.get("status", ""))
        state = state_for_remote_status(remote_status)
        if state is None:
            raise RemoteTransientError(
                operation_id, f"GET {job_id} returned unknown status {remote_status!r}", status_code=status
            )
        outputs = body.get("outputs") or []
        ids = (
            [o.get("id") for o in outputs]
            if isinstance(outputs, list) and all(isinstance(o, dict) for o in outputs)
            else None
        )
        if ids is None or not all(isinstance(i, str) and i for i in ids) or len(set(ids)) != len(ids):
            raise RemoteContractError(
                operation_id,
                f"GET {job_id} returned outputs without distinct string ids: {clean_text(repr(outputs), 300)}",
                status_code=status,
            )
        error = body.get("error")
        return JobSnapshot(
            job_id=job_id,
            status=remote_status,
            state=state,
            outputs=outputs,
            poll_after_s=_poll_after_s(body, response),
            completed_at_ms=_to_ms(body.get("completed_at")),
            error=error if isinstance(error, dict) else None,
            status_code=status,
            duration_ms=duration_ms,
        )
