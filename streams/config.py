"""Settings, durations and key/topic names, defined once.

Every setting is read from an environment variable ``STREAMS_<NAME>`` (upper case), with the default shown
in :class:`Settings`. Durations carry their unit in the name (``_ms``, ``_s``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from streams.errors import ConfigError

#: Topic names; a deployment may prefix them with ``STREAMS_TOPIC_PREFIX``.
TOPIC_SUBMISSIONS = "generation.submissions"
TOPIC_POLLS = "generation.polls"
TOPIC_OUTPUTS_DELIVERED = "generation.outputs.delivered"
TOPIC_TRANSITIONS = "generation.transitions"
TOPIC_DEAD_LETTER = "generation.dead-letter"


@dataclass(frozen=True)
class Settings:
    """Runtime configuration of workers, CLI and tests.

    Raises :class:`~streams.errors.ConfigError` from :meth:`from_env` when a variable does not parse.
    """

    kafka_bootstrap: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    database_url: str = "postgresql://streams:streams@127.0.0.1:5432/streams"
    remote_base_url: str = "http://127.0.0.1:8900"
    remote_api_key: str = "dev-key"
    remote_model: str = "sim-1"

    app_id: str = "generation-streams"
    kafka_session_timeout_s: float = 30.0
    kafka_heartbeat_interval_s: float = 3.0
    topic_prefix: str = ""
    partitions: int = 8
    # Kafka admin calls (topics, consumer-group look-ups) retry the broker's retriable errors this long.
    kafka_admin_deadline_s: float = 60.0

    # Redis leases (seed: ``SET app:observe:operation-42 token NX PX 45000``).
    lease_key_prefix: str = "app"
    lease_ttl_ms: int = 45_000
    redis_socket_timeout_s: float = 1.0

    # Poll scheduling in PostgreSQL.
    visibility_timeout_s: float = 60.0
    poll_scheduler_interval_s: float = 0.2
    poll_batch_size: int = 500
    poll_backoff_base_s: float = 0.5
    poll_backoff_cap_s: float = 30.0
    poll_min_delay_s: float = 0.05
    lease_busy_retry_s: float = 1.0
    submitting_stale_after_s: float = 120.0

    # Outbox relay.
    relay_interval_s: float = 0.05
    relay_batch_size: int = 1000

    # Remote API client timeouts (httpx) and POST retry budget.
    http_connect_timeout_s: float = 2.0
    http_read_timeout_s: float = 10.0
    http_write_timeout_s: float = 5.0
    http_pool_timeout_s: float = 5.0
    http_max_connections: int = 200
    submit_retry_deadline_s: float = 60.0

    # PostgreSQL connections per worker process (statements are short; agents queue on the pool).
    db_pool_max_size: int = 10

    # Agents.
    dispatcher_concurrency: int = 32
    observer_concurrency: int = 64
    # Largest Kafka value read (bytes): a provider request with a long prompt fits (the trace's longest, 14,050
    # tokens, is ~68 KB of text); a dead letter carries up to 512 KiB of the original, so all of such a value.
    max_value_bytes: int = 262_144
    coordination_retry_cap_s: float = 5.0

    # Worker web server (metrics, health).
    web_port: int = 6066
    web_enabled: bool = True

    topics: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        names = {
            "submissions": TOPIC_SUBMISSIONS,
            "polls": TOPIC_POLLS,
            "outputs_delivered": TOPIC_OUTPUTS_DELIVERED,
            "transitions": TOPIC_TRANSITIONS,
            "dead_letter": TOPIC_DEAD_LETTER,
        }
        object.__setattr__(self, "topics", {k: self.topic_prefix + v for k, v in names.items()})
        self._check()

    def _check(self) -> None:
        """Refuse combinations that would break a worker at run time (raises :class:`ConfigError`)."""
        for name in (
            "partitions",
            "lease_ttl_ms",
            "poll_batch_size",
            "relay_batch_size",
            "dispatcher_concurrency",
            "observer_concurrency",
            "db_pool_max_size",
            "http_max_connections",
            "max_value_bytes",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"STREAMS_{name.upper()} must be at least 1")
        post_budget_s = (
            self.submit_retry_deadline_s
            + self.http_connect_timeout_s
            + self.http_write_timeout_s
            + self.http_read_timeout_s
        )
        if self.submitting_stale_after_s <= post_budget_s:
            raise ConfigError(
                f"STREAMS_SUBMITTING_STALE_AFTER_S ({self.submitting_stale_after_s}) must exceed the POST budget "
                f"({post_budget_s:.0f} s: retry deadline + HTTP timeouts), or a live dispatcher's operation would "
                "be reconciled to uncertain while it still waits to retry"
            )
        if self.visibility_timeout_s * 1000 < self.lease_ttl_ms:
            raise ConfigError(
                "STREAMS_VISIBILITY_TIMEOUT_S must be at least the lease TTL "
                f"({self.lease_ttl_ms} ms), or a paused worker's poll returns while its lease still holds"
            )

    @property
    def lease_ttl_s(self) -> float:
        """The lease TTL in seconds."""
        return self.lease_ttl_ms / 1000.0

    def topic(self, role: str) -> str:
        """The full topic name for ``role`` (``submissions``, ``polls``, ``outputs_delivered``, ...)."""
        return self.topics[role]

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied (topic names recomputed)."""
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """``STREAMS_*`` variables that reproduce these settings in a child process."""
        env = {}
        for f in dataclasses.fields(self):
            if f.name == "topics":
                continue
            value = getattr(self, f.name)
            env["STREAMS_" + f.name.upper()] = ("true" if value else "false") if isinstance(value, bool) else str(value)
        return env

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        """Build settings from ``STREAMS_*`` variables over the defaults.

        Raises:
            ConfigError: a variable is set but does not parse as its field's type.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "topics":
                continue
            var = "STREAMS_" + f.name.upper()
            raw = env.get(var)
            if raw is None:
                continue
            default = f.default
            try:
                if isinstance(default, bool):
                    values[f.name] = _parse_bool(raw)
                elif isinstance(default, int):
                    values[f.name] = int(raw)
                elif isinstance(default, float):
                    values[f.name] = float(raw)
                    if not math.isfinite(values[f.name]):
                        raise ValueError("not a finite number")
                else:
                    values[f.name] = raw
            except ValueError as exc:
                raise ConfigError(f"{var}={raw!r} is not a valid {type(default).__name__}: {exc}") from exc
            if isinstance(default, int | float) and not isinstance(default, bool) and values[f.name] < 0:
                raise ConfigError(f"{var}={raw!r} must not be negative")
        return cls(**values)


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def lease_key(settings: Settings, action: str, operation_id: str) -> str:
    """The Redis key of the ``action`` lease (``observe`` or ``submit``) for one operation.

    Shape: ``<prefix>:<action>:<operation_id>``, e.g. ``app:observe:operation-42`` (the seed's example).
    """
    return f"{settings.lease_key_prefix}:{action}:{operation_id}"
