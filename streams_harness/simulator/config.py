"""Configuration of the provider simulator: a pydantic-settings model (:class:`streams.config.ExplicitSettings`)
read from ``SIM_<FIELD>`` variables (:func:`streams.config.env_values`, the project's one environment loader), CLI
options and ``POST /_sim/config``."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from streams.config import ExplicitSettings, callback_secret_key, env_values
from streams_harness.simulator.faults import FaultRates
from streams_harness.simulator.model import (
    DEFAULT_DECODE_MS_PER_TOKEN,
    DEFAULT_PREFILL_MS_PER_TOKEN,
    DEFAULT_QUEUE_MS,
    JobDurations,
    job_durations,
)

ENV_PREFIX = "SIM_"

# Fields that cannot be changed through ``POST /_sim/config`` (they need a restart).
STATIC_FIELDS = frozenset({"host", "port", "access_log", "dialect"})

#: API shapes the simulator serves (the product's shipped declarations of the same names, streams/remote/dialects).
DIALECTS = ("seed-generations", "replicate-predictions")

_RATE_FIELDS = (
    "fault_429",
    "fault_502_job_id",
    "fault_5xx",
    "fault_drop_after_create",
    "fault_slow",
    "fault_job_failed",
    "multi_output_rate",
    "fault_not_found",
    "fault_unknown_status",
    "fault_never_finishes",
    "fault_status_regression",
    "callback_loss",
    "callback_duplicates",
    "callback_reorder",
    "callback_bad_signature",
)


def _f(default: Any, help_text: str) -> Any:
    return Field(default=default, description=help_text)


class SimulatorConfig(ExplicitSettings):
    """All settings of the simulator (immutable, validated on construction: ``ValueError`` on a bad value).

    Every field is a CLI option ``--field-name`` and an env var ``SIM_FIELD_NAME``.

    Rates are probabilities in ``[0, 1]`` (0 = off).  Durations carry their unit in the name.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_ignore_empty=True, frozen=True, extra="forbid", allow_inf_nan=False
    )

    RATE_FIELDS: ClassVar[tuple[str, ...]] = _RATE_FIELDS

    host: str = _f("127.0.0.1", "Address to bind.")
    port: int = _f(8900, "TCP port to bind (0 = any free port).")
    seed: int = _f(0, "Seed of the random.Random driving every fault decision.")
    compression: float = _f(1.0, "Clock speed-up: all job durations are divided by this (> 0).")
    queue_ms: float = _f(DEFAULT_QUEUE_MS, "Queue delay before a job starts, ms (uncompressed).")
    prefill_ms_per_token: float = _f(DEFAULT_PREFILL_MS_PER_TOKEN, "Prefill time per context token, ms.")
    decode_ms_per_token: float = _f(DEFAULT_DECODE_MS_PER_TOKEN, "Decode time per generated token, ms.")
    fault_429: float = _f(0.0, "P(POST answered 429 + Retry-After; nothing created).")
    retry_after_s: int = _f(1, "Retry-After header value on 429, seconds.")
    retry_after_header: str = _f(
        "", "If set: the Retry-After header, verbatim, on every GET answer and every 429 (replaces retry_after_s)."
    )
    retry_after_dates: bool = _f(
        False,
        "Retry-After as an HTTP-date with the answer's Date (RFC 9110 10.2.3) on every 429 of the per-account limit "
        "and, as the poll hint, on every GET answer (rounded up to whole seconds); else delay-seconds on 429s only.",
    )
    output_extra_json: str = _f(
        "", 'If set: raw JSON members spliced verbatim into every output, e.g. {"seed": 18446744073709551616}.'
    )
    fault_502_job_id: float = _f(0.0, "P(POST answered 502 whose body carries the created job id).")
    fault_5xx: float = _f(0.0, "P(POST answered 500/503 without job id; job created 50/50).")
    fault_drop_after_create: float = _f(0.0, "P(job created, connection closed without response).")
    fault_slow: float = _f(0.0, "P(job created, 201 delayed by --slow-response-s).")
    slow_response_s: float = _f(15.0, "Delay of a slow POST response, seconds.")
    fault_job_failed: float = _f(0.0, "P(a created job ends in status failed).")
    multi_output_rate: float = _f(0.1, "P(a succeeded job has a second output).")
    fault_not_found: float = _f(0.0, "P(a created job answers GET with 404 for --not-found-window-s).")
    not_found_window_s: float = _f(5.0, "How long after creation a not_found_window job answers 404, seconds.")
    fault_unknown_status: float = _f(0.0, "P(a created job answers every GET with aborted, paused or null).")
    fault_never_finishes: float = _f(0.0, "P(a created job stays running forever).")
    fault_status_regression: float = _f(0.0, "P(a running job answers queued to every second GET).")
    lookup_enabled: bool = _f(False, "Offer GET /v1/generations?client_reference=... (the real API documents none).")
    lookup_lag_s: float = _f(0.0, "Consistency lag of the lookup: jobs are listed this long after creation, s.")
    price_per_context_token: str = _f("0.0000005", "Charge per context token (decimal, in price_currency).")
    price_per_generated_token: str = _f("0.0000015", "Charge per generated token (decimal, in price_currency).")
    price_currency: str = _f("USD", "Currency of charges and refunds.")
    get_latency_ms: float = _f(5.0, "Simulated work of every GET /v1/generations/{id}, ms.")
    poll_min_ms: int = _f(50, "Lower clamp of poll_after_ms.")
    poll_max_ms: int = _f(5000, "Upper clamp of poll_after_ms.")
    rate_limit_post_per_s: float = _f(
        0.0, "Per-account limit of POSTs per second (0 = off); over it: 429 with Retry-After, counted."
    )
    rate_limit_get_per_s: float = _f(
        0.0, "Per-account limit of GETs per second (0 = off); over it: 429 with Retry-After, counted."
    )
    rate_limit_burst: int = _f(1, "Requests of one kind an account may send at once under the limit (>= 1).")
    concurrency_limit_per_account: int = _f(
        0, "Jobs of one account queued or running at once (0 = off); a POST over it gets the throttled answer."
    )
    concurrency_limit_per_model: int = _f(
        0, "Jobs of one account and model queued or running at once (0 = off); over it: the throttled answer."
    )
    output_ttl_s: float = _f(0.0, "If above 0: each output carries expires_at = completion + this (unix s).")
    throttled_status: int = _f(400, "HTTP status of the throttled answer (the concurrency limit's refusal).")
    throttled_code: str = _f("THROTTLED", "error.code of the throttled answer (with Retry-After: retry_after_s).")
    access_log: bool = _f(False, "Log every request (slows the server down).")
    dialect: str = _f(
        "seed-generations",
        "API shape served: seed-generations (/v1/generations) or replicate-predictions (/v1/predictions, "
        "statuses starting|processing|..., output values, urls, Prefer: wait); the same jobs underneath.",
    )
    prefer_wait_max_s: float = _f(5.0, "Longest a create call with Prefer: wait is held for its job to end, s.")
    callback_url: str = _f("", "Where completion callbacks are POSTed (Standard Webhooks); empty: none sent.")
    callback_secret: str = _f(
        "", "Signing secret of the callbacks (whsec_<base64>); a test secret, masked in GET/POST /_sim/config."
    )
    callback_delay_ms: float = _f(0.0, "Delay of a completion callback after the job ends, ms (not compressed).")
    callback_loss: float = _f(0.0, "P(a job's completion callback is never sent).")
    callback_duplicates: float = _f(0.0, "P(a completion callback is sent twice with the same webhook-id).")
    callback_reorder: float = _f(0.0, "P(a callback is held back up to callback_reorder_window_ms more).")
    callback_reorder_window_ms: float = _f(500.0, "Longest extra hold of a reordered callback, ms.")
    callback_bad_signature: float = _f(0.0, "P(a callback is signed with a key the receiver does not know).")
    callback_attempts: int = _f(3, "Attempts of one callback delivery while the receiver answers non-2xx (>= 1).")
    record_bodies: bool = _f(False, "Keep every POST body, shown per client reference (tests of what arrived).")

    @model_validator(mode="after")
    def _check(self) -> SimulatorConfig:
        """Validate ranges."""
        for name in _RATE_FIELDS:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value!r}")
        if self.compression <= 0:
            raise ValueError("compression must be > 0")
        for name in (
            "queue_ms",
            "prefill_ms_per_token",
            "decode_ms_per_token",
            "slow_response_s",
            "get_latency_ms",
            "retry_after_s",
            "not_found_window_s",
            "lookup_lag_s",
            "rate_limit_post_per_s",
            "rate_limit_get_per_s",
            "concurrency_limit_per_account",
            "concurrency_limit_per_model",
            "prefer_wait_max_s",
            "callback_delay_ms",
            "callback_reorder_window_ms",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {list(DIALECTS)}, got {self.dialect!r}")
        if self.callback_attempts < 1:
            raise ValueError("callback_attempts must be >= 1")
        if self.callback_url:
            if not self.callback_url.startswith(("http://", "https://")):
                raise ValueError("callback_url must be an http(s) URL")
            try:
                callback_secret_key(self.callback_secret)
            except ValueError:
                raise ValueError("callback_url needs callback_secret, whsec_<base64>") from None
        if self.rate_limit_burst < 1:
            raise ValueError("rate_limit_burst must be >= 1")
        if not 400 <= self.throttled_status <= 599:
            raise ValueError("throttled_status must be an HTTP error status (400..599)")
        if not 0 <= self.poll_min_ms <= self.poll_max_ms:
            raise ValueError("need 0 <= poll_min_ms <= poll_max_ms")
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be within [0, 65535]")
        extra = self.output_extra_json.strip()
        if extra and not (extra.startswith("{") and extra.endswith("}") and extra[1:-1].strip()):
            raise ValueError("output_extra_json must be the text of a non-empty JSON object")
        for name in ("price_per_context_token", "price_per_generated_token"):
            try:
                price = Decimal(getattr(self, name))
            except InvalidOperation:
                raise ValueError(f"{name} must be a decimal number, got {getattr(self, name)!r}") from None
            if not price.is_finite() or price < 0:
                raise ValueError(f"{name} must be a finite decimal >= 0")
        return self

    @property
    def fault_rates(self) -> FaultRates:
        """The fault probabilities as consumed by :class:`~streams_harness.simulator.faults.FaultDecider`."""
        return FaultRates(
            rate_limited_429=self.fault_429,
            upstream_502=self.fault_502_job_id,
            internal_5xx=self.fault_5xx,
            drop_after_create=self.fault_drop_after_create,
            slow_response=self.fault_slow,
            job_failed=self.fault_job_failed,
            multi_output=self.multi_output_rate,
            not_found_window=self.fault_not_found,
            unknown_status=self.fault_unknown_status,
            never_finishes=self.fault_never_finishes,
            status_regression=self.fault_status_regression,
        )

    def durations(self, context_tokens: int, generated_tokens: int) -> JobDurations:
        """Phase durations (ms, compressed) of a job of this size under this config."""
        return job_durations(
            context_tokens,
            generated_tokens,
            queue_ms=self.queue_ms,
            prefill_ms_per_token=self.prefill_ms_per_token,
            decode_ms_per_token=self.decode_ms_per_token,
            compression=self.compression,
        )

    def to_dict(self) -> dict[str, Any]:
        """All fields as a JSON-ready dict (the shape returned by ``POST /_sim/config``), the callback secret
        masked."""
        return {**self.model_dump(), "callback_secret": "**********" if self.callback_secret else ""}

    def updated(self, changes: Mapping[str, Any], *, allow_static: bool = True) -> SimulatorConfig:
        """Return a validated copy with ``changes`` applied (text such as ``"0.02"`` is read as its field's type).

        Raises:
            ValueError: on an unknown field, a value of the wrong type, a static field
                when ``allow_static`` is false, or an out-of-range value.
        """
        for name in changes:
            if name not in type(self).model_fields:
                raise ValueError(f"unknown config field {name!r}")
            if not allow_static and name in STATIC_FIELDS:
                raise ValueError(f"config field {name!r} cannot be changed at runtime")
        try:
            return type(self)(**{**self.model_dump(), **changes})
        except ValidationError as exc:
            raise ValueError(_explain(exc)) from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SimulatorConfig:
        """Defaults overridden by ``SIM_<FIELD>`` environment variables (e.g. ``SIM_FAULT_429=0.02``; empty ones
        are ignored).

        Raises:
            ValueError: a variable does not parse or is out of range.
        """
        return cls().updated(env_values(cls, environ))


def _explain(exc: ValidationError) -> str:
    """``field: message`` for each refused value."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {str(e['msg']).removeprefix('Value error, ')}"
        for e in exc.errors(include_url=False)
    )


def field_types() -> dict[str, type]:
    """Map of field name to its Python type (``str``, ``int``, ``float`` or ``bool``)."""
    types: dict[str, type] = {}
    for name, info in SimulatorConfig.model_fields.items():
        assert isinstance(info.annotation, type)
        types[name] = info.annotation
    return types


def field_help() -> dict[str, str]:
    """Map of field name to its one-line help text."""
    return {name: info.description or "" for name, info in SimulatorConfig.model_fields.items()}
