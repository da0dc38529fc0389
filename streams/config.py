"""Settings, durations and key/topic names, defined once.

Every setting is read from an environment variable ``STREAMS_<NAME>`` (upper case), with the default shown
in :class:`Settings`, by pydantic-settings (:meth:`Settings.from_env`); durations carry their unit in the name
(``_ms``, ``_s``).

Secrets never reach a log line, a repr, a report or a dead letter: the API key is a :class:`~pydantic.SecretStr`
and every URL that may hold a password (PostgreSQL, Redis, the remote API) a :class:`SecretUrl`, shown with its
password masked (:func:`mask_url`); code that needs the value asks for it (``.get_secret_value()``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import AfterValidator, BeforeValidator, Field, SecretStr, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from streams.errors import ConfigError

#: Topic names; a deployment may prefix them with ``STREAMS_TOPIC_PREFIX``.
TOPIC_SUBMISSIONS = "generation.submissions"
TOPIC_POLLS = "generation.polls"
TOPIC_OUTPUTS_DELIVERED = "generation.outputs.delivered"
TOPIC_TRANSITIONS = "generation.transitions"
TOPIC_DEAD_LETTER = "generation.dead-letter"
TOPIC_CANCELLATIONS = "generation.cancellations"

#: Prefix of every setting's environment variable.
ENV_PREFIX = "STREAMS_"

#: Values of ``STREAMS_HTTP_TRANSPORT`` (see :func:`streams.remote.client.make_http_client`).
HTTP_TRANSPORTS = ("aiohttp", "httpx")
HttpTransport = Literal["aiohttp", "httpx"]

#: Values of ``STREAMS_EVENT_LOOP`` (see :func:`streams.cli.worker`).
EventLoop = Literal["uvloop", "asyncio"]

#: Redis connections beyond one per agent slot (see :attr:`Settings.redis_max_connections`).
REDIS_SPARE_CONNECTIONS = 8

#: What a masked password reads as.
MASK = "***"

#: Query parameters of a URL that carry a password (libpq's ``password``, and common spellings).
_SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "api_key", "apikey"})


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``: in the user info (``scheme://user:secret@host``,
    ``redis://:secret@host``) and in query parameters such as ``?password=secret``. Anything that does not parse
    as a URL is masked whole (it might be a password)."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a malformed port, where the netloc may be anything
    except ValueError:
        return MASK
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else f"{userinfo}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
            query = urlencode([(k, MASK if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class SecretUrl(SecretStr):
    """A URL that may hold a password: ``str()`` and ``repr()`` show it masked (:func:`mask_url`), so host,
    port and database stay readable in logs; ``get_secret_value()`` gives the URL itself."""

    def _display(self) -> str:  # pydantic: the text str() and repr() show
        return mask_url(self.get_secret_value())


def _parse_bool(raw: Any) -> Any:
    """Environment booleans: 1/0, true/false, yes/no, on/off (any case, blanks around), empty = false."""
    if not isinstance(raw, str):
        return raw
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _int_text(raw: Any) -> Any:
    """Integers from text as Python's ``int()`` reads them (``3.0`` is not an integer)."""
    return int(raw) if isinstance(raw, str) else raw


def _at_least_one(value: int) -> int:
    if value < 1:
        raise PydanticCustomError("at_least_one", "must be at least 1")
    return value


EnvBool = Annotated[bool, BeforeValidator(_parse_bool)]
PositiveInt = Annotated[int, BeforeValidator(_int_text), Field(ge=0), AfterValidator(_at_least_one)]
Count = Annotated[int, BeforeValidator(_int_text), Field(ge=0)]
#: A TCP port to listen on (0, "any free port", would leave the live view and /metrics where nobody looks).
Port = Annotated[int, BeforeValidator(_int_text), Field(ge=1, le=65535)]
Seconds = Annotated[float, Field(ge=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
#: Values of ``STREAMS_KAFKA_SECURITY_PROTOCOL`` and ``STREAMS_KAFKA_SASL_MECHANISM`` (:mod:`streams.kafka_security`).
KafkaSecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
KafkaSaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]


def _replication(value: int) -> int:
    if value == 0 or value < -1:
        raise PydanticCustomError("replication", "must be -1 (the broker's default) or at least 1")
    return value


#: A topic's replication factor: -1 lets the broker decide (CreateTopics' "use the default").
KafkaReplication = Annotated[int, BeforeValidator(_int_text), AfterValidator(_replication)]
#: A provider account's name as this project writes it into Redis keys (never the API key).
AccountName = Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]


class _EnvironSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping (``os.environ`` or a test's dict)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


def env_values(settings_cls: type[BaseSettings], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The values pydantic-settings reads for ``settings_cls`` from ``environ`` (default ``os.environ``): each
    field from ``<env_prefix><FIELD>`` in any case, as text, unknown variables ignored. The one environment
    loader of the project (the worker's :class:`Settings`, the simulator's ``SIM_*`` configuration)."""
    return _EnvironSource(settings_cls, os.environ if environ is None else environ)()


#: Variables under :data:`ENV_PREFIX` that are the test suite's and the harness's, never the product's settings.
TEST_ENV_PREFIX = "STREAMS_TEST_"
#: ``STREAMS_*`` variables of the product that are not :class:`Settings` fields: the operator's name
#: (:func:`streams.oncall.operations.given_actor`), the log format (:data:`streams.logs.FORMAT_ENV`) and the
#: worker's start attempt (:data:`streams.worker.process.START_ATTEMPT_ENV`).
OTHER_PRODUCT_VARIABLES = frozenset({"STREAMS_ACTOR", "STREAMS_LOG_FORMAT", "STREAMS_WORKER_START_ATTEMPT"})


def unknown_variables(settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> list[str]:
    """The variables of ``environ`` under :data:`ENV_PREFIX` (any case, as pydantic-settings reads them) that name
    no field of ``settings_cls`` and are neither :data:`OTHER_PRODUCT_VARIABLES` nor under :data:`TEST_ENV_PREFIX`,
    sorted."""
    fields = {ENV_PREFIX + name.upper() for name in settings_cls.model_fields}
    known = fields | OTHER_PRODUCT_VARIABLES
    return sorted(
        name
        for name in environ
        if name.upper().startswith(ENV_PREFIX)
        and not name.upper().startswith(TEST_ENV_PREFIX)
        and name.upper() not in known
    )


class ExplicitSettings(BaseSettings):
    """A pydantic-settings model whose construction takes only the values given: the environment is read by its
    ``from_env`` alone, through :func:`env_values` (the worker's :class:`Settings` and the simulator's
    configuration, which derives from this class too)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only the values passed to the constructor (pydantic-settings' hook)."""
        return (init_settings,)


class Settings(ExplicitSettings):
    """Runtime configuration of workers, CLI and tests (immutable, validated on construction).

    ``Settings(**values)`` is the defaults with ``values``; :meth:`from_env` reads ``STREAMS_*`` variables;
    :meth:`replace` copies with changes. Every way raises :class:`~streams.errors.ConfigError` naming the
    variable when a value does not parse or would break a worker (never showing a secret).
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, allow_inf_nan=False, extra="forbid", validate_default=True
    )

    #: Fields whose values are secrets (never shown, not even in an error message).
    SECRET_FIELDS: ClassVar[frozenset[str]] = frozenset(
        {
            "remote_api_key",
            "database_url",
            "redis_url",
            "remote_base_url",
            "kafka_sasl_password",
            "kafka_ssl_key_password",
            "redis_sentinel_password",
            "web_auth_token",
            "web_auth_password",
        }
    )

    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers (host:port, comma-separated).")
    redis_url: SecretUrl = Field(
        SecretUrl("redis://127.0.0.1:6379/0"),
        description="Redis URL of the leases and the rate budget (a password in it is masked when shown).",
    )
    database_url: SecretUrl = Field(
        SecretUrl("postgresql://streams:streams@127.0.0.1:5432/streams"),
        description="PostgreSQL URL of the ledger (a password in it is masked when shown).",
    )
    remote_base_url: SecretUrl = Field(
        SecretUrl("http://127.0.0.1:8900"), description="Base URL of the remote generation API."
    )
    remote_api_key: SecretStr = Field(
        SecretStr("dev-key"), description="API key of the remote generation API (sent as a bearer token; never shown)."
    )
    remote_model: str = Field("sim-1", description="Model put into a request that names none.")

    app_id: str = Field("generation-streams", description="Faust application id: the consumer group of the workers.")
    kafka_session_timeout_s: Seconds = Field(
        30.0, description="Kafka consumer session timeout (s): a worker silent this long leaves the group."
    )
    kafka_heartbeat_interval_s: Seconds = Field(3.0, description="Kafka consumer heartbeat interval (s).")
    topic_prefix: str = Field("", description="Prefix of every topic name (e.g. a run's or a deployment's).")
    partitions: PositiveInt = Field(8, description="Partitions of each topic `streams migrate` creates.")
    # Kafka admin calls (topics, consumer-group look-ups) retry the broker's retriable errors this long.
    kafka_admin_deadline_s: Seconds = Field(
        60.0, description="How long a Kafka admin call retries the broker's retriable errors (s)."
    )

    # Redis leases (seed: ``SET app:observe:operation-42 token NX PX 45000``). The prefix starts every Redis key
    # of the product (leases, the rate budget).
    lease_key_prefix: str = Field(
        "app", description="Prefix of every Redis key of the product (leases, the rate budget)."
    )
    lease_ttl_ms: PositiveInt = Field(45_000, description="TTL of a Redis lease on one operation (ms).")
    #: Seconds a Redis command waits for its answer before Redis counts as unavailable.
    redis_socket_timeout_s: Seconds = Field(
        1.0, description="How long a Redis command waits for its answer before Redis counts as unavailable (s)."
    )
    #: Seconds to open one new pooled connection (TCP connect). Longer than the command timeout: connections are
    #: opened in bursts (a worker starting with every agent slot busy opens them all at once), and on a loaded
    #: machine a burst of 100 takes over a second, which is the worker's own load, not Redis being down.
    redis_connect_timeout_s: Seconds = Field(
        5.0, description="How long opening one pooled Redis connection may take (s)."
    )
    #: Seconds a Redis command waits for a free pooled connection before it is reported "busy" (this worker's
    #: own load: the lease counts as not taken, never as a Redis outage). The pool's size is derived, see
    #: :attr:`redis_max_connections`.
    redis_pool_timeout_s: Seconds = Field(
        5.0, description="How long a Redis command waits for a free pooled connection before it is reported busy (s)."
    )

    # Poll scheduling in PostgreSQL.
    visibility_timeout_s: Seconds = Field(
        60.0,
        description="How long a claimed poll stays invisible before it is claimed again (s); at least the lease TTL.",
    )
    poll_scheduler_interval_s: Seconds = Field(
        0.2,
        description="Wait of the poll scheduler after a round that left due polls unclaimed (held back by the rate "
        "budget, back-pressure or Redis) (s); otherwise it sleeps until the next poll is due.",
    )
    poll_batch_size: PositiveInt = Field(500, description="Polls the scheduler claims at most per tick.")
    # A job whose POST answer hints its first poll this soon has that poll claimed by the save of its job id and
    # taken in the same worker (streams/worker/stages/firstpoll.py): no scheduler claim, no poll event.
    first_poll_in_process_max_s: Seconds = Field(
        1.0,
        description="Longest first-poll delay (the POST answer's hint, or poll_backoff_base_s without one) for which "
        "the worker that saved the job id takes the first poll itself (s); 0: every first poll goes through the poll "
        "scheduler.",
    )
    poll_backoff_base_s: Seconds = Field(0.5, description="First delay of a job's poll backoff (s).")
    poll_backoff_cap_s: Seconds = Field(30.0, description="Longest delay between two polls of one job (s).")
    poll_min_delay_s: Seconds = Field(0.05, description="Shortest delay between two polls of one job (s).")
    # The API's poll hint is followed as it is for a job's first this many observations; from then on a capped
    # exponential floor applies, so a job the provider keeps calling "almost done" costs few GETs.
    poll_hint_trusted_polls: Count = Field(
        8, description="Observations of a job for which the API's poll hint is followed as it is."
    )
    lease_busy_retry_s: Seconds = Field(1.0, description="Wait before trying again a lease another worker holds (s).")
    submitting_stale_after_s: Seconds = Field(
        120.0, description="Age after which an operation left submitting is reconciled to uncertain (s)."
    )
    # An operation still 'accepted' this long after its last change is dispatched again from the ledger.
    accepted_stale_after_s: Seconds = Field(
        60.0, description="Age after which an operation left accepted is dispatched again from the ledger (s)."
    )

    # When a known job stops making progress, polling stops (state ``stalled``) until an operator acts:
    # a GET answering 404 longer than this after the job id was saved (inside it, a 404 only reschedules) ...
    not_found_grace_s: Seconds = Field(
        60.0, description="How long after its job id was saved a 404 only reschedules the poll (s); later it stalls."
    )
    # ... a status the client does not know, this many GETs in a row ...
    unknown_status_limit: PositiveInt = Field(
        5, description="GETs in a row with a status the client does not know before the operation stalls."
    )
    # ... or a job observed longer than this without becoming terminal.
    max_observation_age_s: Seconds = Field(
        86_400.0, description="Longest observation of a job without it becoming terminal before it stalls (s)."
    )

    # Reconciliation of ``uncertain`` by looking the job up at the provider by its client reference (the
    # operation id the POST carried). Off by default: the API must offer such a lookup. The first lookup waits
    # ``lookup_lag_s`` after the operation became uncertain (the provider's consistency lag), so "none found"
    # can be trusted; it is then left for a person.
    lookup_enabled: EnvBool = Field(
        False, description="Look uncertain operations up at the provider by client reference (the API must offer it)."
    )
    lookup_lag_s: Seconds = Field(
        30.0,
        description="Wait after an operation became uncertain before its first lookup (s; the provider's lag).",
    )

    # Outbox relay.
    relay_interval_s: Seconds = Field(
        0.05, description="Wait of the outbox relay after a round that failed (an outage) before the next (s)."
    )
    relay_batch_size: PositiveInt = Field(1000, description="Outbox rows the relay publishes at most per tick.")

    # Remote calls and the lease that covers them. Every remote call (POST or GET) ends within
    # ``remote_call_deadline_s`` as a whole (waiting for a pooled connection, connecting, sending and reading the
    # entire answer), whatever the per-phase httpx timeouts below allow: a provider that trickles its answer
    # a byte at a time cannot keep a call open past it. The lease held around the call is renewed right
    # before it (and every third of its TTL during a GET) and must outlive it by ``lease_margin_s``:
    # ``remote_call_deadline_s + lease_margin_s < lease TTL`` (checked below). A GET cut off after its
    # request was sent may still be served by the provider: its lease is left to expire (not released) and the
    # job's next poll waits a full lease TTL, so the provider has that long to notice the closed connection.
    remote_call_deadline_s: Seconds = Field(30.0, description="Deadline of one whole remote call, POST or GET (s).")
    lease_margin_s: Seconds = Field(
        10.0, description="How much longer than a remote call the lease around it must live (s)."
    )

    # Per-phase timeouts of the remote API client (httpx, seconds) and the POST retry budget.
    http_connect_timeout_s: Seconds = Field(2.0, description="Remote API client: connect timeout (s).")
    http_read_timeout_s: Seconds = Field(10.0, description="Remote API client: read timeout (s).")
    http_write_timeout_s: Seconds = Field(5.0, description="Remote API client: write timeout (s).")
    http_pool_timeout_s: Seconds = Field(5.0, description="Remote API client: wait for a pooled connection (s).")
    submit_retry_deadline_s: Seconds = Field(
        60.0, description="How long a POST is retried after a refusal that allows it (s)."
    )
    #: What carries the remote client's requests: ``aiohttp`` (:mod:`streams.remote.transport`, the default: about a
    #: fifth of httpx's own CPU per request) or ``httpx`` (httpx's own httpcore pool).
    http_transport: HttpTransport = Field(
        "aiohttp", description="What carries the remote client's requests: aiohttp or httpx."
    )
    #: The worker's event loop: ``uvloop`` (the default; libuv under asyncio, what faust-streaming's own
    #: ``faust[uvloop]`` extra installs) or ``asyncio`` (the standard library's selector loop).
    event_loop: EventLoop = Field("uvloop", description="The worker's event loop: uvloop or asyncio.")
    #: How long a starting worker waits for PostgreSQL, Redis and Kafka to answer real commands before it exits
    #: non-zero naming the service (:mod:`streams.worker.process`).
    startup_timeout_s: Seconds = Field(
        300.0, description="How long a starting worker waits for PostgreSQL, Redis and Kafka (s)."
    )
    stop_timeout_s: Annotated[float, Field(gt=0)] = Field(
        25.0,
        description="Longest a worker takes to stop after SIGTERM or SIGINT (s); past it, it exits at once (status "
        "5, an ERROR line): nothing is lost, the events it had not handled are handled by the next owner of their "
        "partitions. Keep it below the orchestrator's grace period (Kubernetes: 30 s by default).",
    )

    # Rate budget of the provider account, shared by every worker process through Redis
    # (streams/coordination/ratebudget.py,
    # docs/guarantees.md, "Rate budget"). Rates in requests per second, POSTs and GETs apart; 0 = no pacing (a 429's
    # Retry-After still pauses every worker's calls of that kind). Bursts in requests: how many may go at once
    # after a quiet spell. Workers on the same Redis with the same key prefix and account share one budget;
    # set the rates a little below the provider's limits (network jitter bunches requests on the way).
    remote_account: AccountName = Field(
        "default", description="Name of the provider account whose rate budget the workers share (in Redis keys)."
    )
    remote_post_rate_per_s: NonNegativeFloat = Field(
        0.0, description="POSTs per second of the shared rate budget (0: no pacing)."
    )
    remote_post_burst: PositiveInt = Field(1, description="POSTs that may go at once after a quiet spell.")
    remote_get_rate_per_s: NonNegativeFloat = Field(
        0.0, description="GETs per second of the shared rate budget (0: no pacing)."
    )
    remote_get_burst: PositiveInt = Field(1, description="GETs that may go at once after a quiet spell.")

    # Concurrency and pool sizes, one place. The agents' concurrency is the input; each agent slot handles one
    # event at a time and so holds at most one remote call, one Redis command and one PostgreSQL statement at
    # once. The HTTP and Redis pools are derived from it (:attr:`http_max_connections`,
    # :attr:`redis_max_connections`) so a worker's own load never exhausts them; when a pool is briefly short
    # (background lease releases, health checks) callers wait for a connection, and a wait that runs out is
    # "busy", never an outage. PostgreSQL is the exception: its connections are shared by every worker
    # against the server's ``max_connections``, so ``db_pool_max_size`` is set per worker and agents queue on
    # the pool (asyncpg waits for a free connection without a limit; statements are short). Size it so that
    # workers x db_pool_max_size + other clients stays below the server's ``max_connections``.
    # Defaults chosen with ``streams bench`` (docs/benchmark.md; the measurements in CHANGELOG.md).
    dispatcher_concurrency: PositiveInt = Field(64, description="Submissions a worker handles at once.")
    observer_concurrency: PositiveInt = Field(128, description="Polls a worker handles at once.")
    db_pool_max_size: PositiveInt = Field(10, description="PostgreSQL connections of one worker's pool.")

    # Largest Kafka value read (bytes): a provider request with a long prompt fits (the trace's longest, 14,050
    # tokens, is ~68 KB of text); a dead letter carries up to 512 KiB of the original, so all of such a value.
    max_value_bytes: PositiveInt = Field(
        262_144, description="Largest Kafka value read (bytes); larger ones are dead-lettered."
    )
    coordination_retry_cap_s: Seconds = Field(
        5.0, description="Longest wait between retries after Redis or Kafka did not answer (s)."
    )

    # Seconds a pooled PostgreSQL connection may stay idle before the pool closes it (asyncpg's
    # ``max_inactive_connection_lifetime``; 0 keeps them open): a quiet worker gives back the connections that the
    # fleet shares against the server's ``max_connections``, and opens them again when work comes.
    db_pool_idle_lifetime_s: Seconds = Field(
        60.0, description="How long a pooled PostgreSQL connection may stay idle before it is closed (s; 0: kept)."
    )

    # Worker web server (metrics, health).
    web_port: Port = Field(
        6066,
        description="Port of the worker's web server: the live view, /metrics, the probes /livez and /readyz, and the "
        "callback endpoint when callbacks are on.",
    )
    web_enabled: EnvBool = Field(True, description="Run the worker's web server.")

    # Retention of the dead-letter topic: `streams migrate` sets its retention.ms to this (dead letters hold
    # user prompts; docs/operating-data.md "Retention and erasure").
    dead_letter_retention_ms: PositiveInt = Field(
        14 * 86_400_000,
        description="retention.ms `streams migrate` sets on the dead-letter topic (ms; dead letters hold prompts).",
    )

    # Secured and replicated services (docs/production-services.md). Every Kafka client of the product (the
    # worker's Faust app, the admin calls, the submission producer, ``follow``, the operators' topic reads) takes
    # these from one place, :mod:`streams.kafka_security`. File settings are paths to PEM files; empty = unset.
    kafka_security_protocol: KafkaSecurityProtocol = Field(
        "PLAINTEXT",
        description="PLAINTEXT, SSL (TLS, optionally with a client certificate), SASL_PLAINTEXT or SASL_SSL",
    )
    kafka_ssl_ca_file: str = Field("", description="CA bundle that signs the brokers' certificates (empty: system CAs)")
    kafka_ssl_cert_file: str = Field("", description="client certificate for mutual TLS (with kafka_ssl_key_file)")
    kafka_ssl_key_file: str = Field("", description="private key of the client certificate")
    kafka_ssl_key_password: SecretStr = Field(SecretStr(""), description="password of the key file, if encrypted")
    kafka_ssl_check_hostname: EnvBool = Field(True, description="check the broker's certificate names its host")
    kafka_sasl_mechanism: KafkaSaslMechanism = Field(
        "PLAIN", description="PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER (SASL_* protocols only)"
    )
    kafka_sasl_username: str = Field("", description="SASL user (PLAIN, SCRAM-*)")
    kafka_sasl_password: SecretStr = Field(SecretStr(""), description="SASL password (PLAIN, SCRAM-*)")
    kafka_sasl_oauth_token_provider: str = Field(
        "",
        description="module:callable returning an aiokafka AbstractTokenProvider (OAUTHBEARER only)",
    )
    kafka_replication_factor: KafkaReplication = Field(
        -1, description="replicas of each product topic; -1 = the broker's default.replication.factor"
    )
    kafka_min_insync_replicas: Count = Field(
        0, description="min.insync.replicas of each product topic; 0 = the broker's default"
    )
    kafka_delivery_timeout_s: Seconds = Field(
        30.0, description="seconds a produced record may wait for its acknowledgement (acks=all) before it fails"
    )
    kafka_metadata_max_age_s: Seconds = Field(
        30.0, description="seconds between metadata refreshes: new partitions are read within this"
    )
    redis_ssl_ca_file: str = Field("", description="CA bundle for a rediss:// Redis (empty: system CAs)")
    redis_ssl_cert_file: str = Field("", description="client certificate for Redis TLS (with redis_ssl_key_file)")
    redis_ssl_key_file: str = Field("", description="private key of the Redis client certificate")
    redis_ssl_check_hostname: EnvBool = Field(True, description="check the Redis certificate names its host")
    redis_sentinels: str = Field("", description="Redis Sentinel addresses host:port,...; empty = no Sentinel")
    redis_sentinel_master: str = Field("", description="name of the master the sentinels watch")
    redis_sentinel_password: SecretStr = Field(SecretStr(""), description="password of the sentinels themselves")
    database_statement_cache_size: Count = Field(
        100, description="asyncpg's prepared statement cache per connection; 0 behind PgBouncer in transaction mode"
    )
    remote_ca_file: str = Field("", description="CA bundle that signs the provider's certificate (empty: system CAs)")
    remote_client_cert_file: str = Field("", description="client certificate for the provider (mutual TLS)")
    remote_client_key_file: str = Field("", description="private key of the provider client certificate")
    remote_auth_header: str = Field(
        "Authorization", pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$", description="header that carries the API key"
    )
    remote_auth_scheme: str = Field(
        "Bearer",
        pattern=r"^[A-Za-z0-9._~+/-]*$",
        description="scheme before the key in that header; empty = the key alone",
    )
    remote_allow_plain_http: EnvBool = Field(
        False, description="allow an http:// provider URL other than loopback (the API key then travels unencrypted)"
    )

    # The worker's web server, safe to expose (docs/operations-http-and-alerts.md).
    web_bind: str = Field(
        "127.0.0.1",
        description="Address the worker's web server listens on (loopback by default; 0.0.0.0 in a container).",
    )
    web_allowed_hosts: str = Field(
        "127.0.0.1,localhost,::1",
        description="Comma-separated host names the web server answers (the Host header without its port); "
        "'*' answers any. Other hosts get 421.",
    )
    web_auth_token: SecretStr = Field(
        SecretStr(""),
        description="Bearer token that opens the live view (Authorization: Bearer <token>); empty: no token.",
    )
    web_auth_user: str = Field("", description="User name of the live view's basic credentials; empty: none.")
    web_auth_password: SecretStr = Field(
        SecretStr(""), description="Password of the live view's basic credentials (with web_auth_user)."
    )
    web_auth_probes: EnvBool = Field(False, description="Ask credentials for /livez, /readyz and /healthz too.")
    web_auth_metrics: EnvBool = Field(False, description="Ask credentials for /metrics too.")
    web_show_payloads: EnvBool = Field(
        False, description="Show operations' requests, sources and outputs' payloads in the live view."
    )
    web_snapshot_interval_s: Seconds = Field(
        10.0, description="Seconds between the worker's snapshots of the ledger and Kafka (gauges, live view)."
    )
    web_probe_timeout_s: Seconds = Field(
        2.0, description="Seconds /readyz waits for each service's answer before it reports it unavailable."
    )

    # The web server's bounds (streams.oncall.webserver, docs/operations-http-and-alerts.md).
    web_max_connections: PositiveInt = Field(
        256,
        description="Connections the worker's web server holds at once; a connection beyond them is answered 503 "
        "at once and closed.",
    )
    web_header_timeout_s: Seconds = Field(
        10.0,
        description="Seconds a connection to the web server has to send a request's headers (and may stay idle "
        "between two requests) before it is closed.",
    )

    # Edges toward the provider (docs/provider-edges.md).
    # An answer over remote_answer_max_bytes is classified: a POST's -> ``uncertain`` (a job may exist), a GET's
    # -> another poll with backoff, counted as a failed poll. A longer ``Retry-After`` than
    # remote_shared_pause_cap_s (or one skewed by a clock) delays only that worker's own retry of the call.
    remote_answer_max_bytes: PositiveInt = Field(
        4 * 1024 * 1024,
        description="Largest answer body accepted from the remote API, in bytes after Content-Encoding is decoded "
        "(a body is never held beyond it).",
    )
    failed_poll_limit: PositiveInt = Field(
        20,
        description="Failed GETs of a job in a row (5xx, 3xx, unreadable or oversized body, another job's 200, "
        "connection errors, timeouts) after which it becomes stalled (reason code poll_failures).",
    )
    remote_shared_pause_cap_s: Seconds = Field(
        60.0, description="Longest pause (s) one worker may write into the account's shared rate budget after a 429."
    )
    # Cancellation (docs/cancellation.md).
    remote_cancel_path: str = Field(
        "/v1/generations/{job_id}/cancel",
        description="Path of the provider's cancel route (POST), with {job_id} where the quoted job id goes.",
        pattern=r"^/.*\{job_id\}",
    )
    cancel_attempt_limit: PositiveInt = Field(
        8,
        description="Calls of the provider's cancel route for one job without a definite answer (429, 5xx, "
        "timeouts), one per poll with the poll's backoff, after which it is not asked again (logged).",
    )

    # The worker's clock against the database's (docs/provider-edges.md, "Time from its source").
    clock_check_interval_s: Seconds = Field(
        60.0,
        description="Seconds between two measurements of this worker's wall clock against PostgreSQL's "
        "(the first at start); exported as streams_clock_skew_seconds.",
    )
    clock_skew_warn_s: Seconds = Field(
        1.0,
        description="Skew (s, either way) of this worker's wall clock against PostgreSQL's above which each "
        "measurement logs a WARNING.",
    )

    # Concurrency budget and output expiry (docs/budgets-and-expiry.md). Jobs running at once at the provider are
    # counted in Redis per account and per model (streams/coordination/running.py), each slot tied to its operation
    # id with a TTL refreshed by every GET of the job; 0 = no limit. Throttled answers are 4xx answers whose
    # error.code is listed, treated like a 429.
    remote_account_max_running: Count = Field(
        0, description="Jobs of the account running at the provider at once, for every worker together (0: no limit)."
    )
    remote_model_max_running: Count = Field(
        0, description="Jobs of one model running at the provider at once, for every worker together (0: no limit)."
    )
    remote_running_slot_ttl_s: Seconds = Field(
        300.0,
        description="How long a running-job slot lasts without a GET of its job (s): a worker that dies mid-job "
        "frees its slots after it; longer than the longest delay between two polls.",
    )
    remote_throttled_codes: str = Field(
        "THROTTLED",
        description="Comma-separated error.code values of a 4xx answer that mean throttled (treated like a 429: "
        "retried after Retry-After, every worker's calls of that kind paused); empty: none.",
    )
    remote_output_ttl_s: Seconds = Field(
        0.0,
        description="How long the provider keeps an output fetchable after its job completed (s), when the answer "
        "gives no expires_at (0: unknown, no expiry carried).",
    )
    # Provider dialect (docs/provider-dialects.md): the API shape, declared.
    provider_dialect: str = Field(
        "seed-generations",
        min_length=1,
        description="Declaration of the provider's API shape: a shipped one (seed-generations, "
        "replicate-predictions) or the path of a JSON file; an unknown one is refused at start. "
        "STREAMS_REMOTE_AUTH_HEADER, _AUTH_SCHEME and _CANCEL_PATH, when set, override its values.",
    )
    output_expiry_margin_s: Seconds = Field(
        600.0,
        description="An output delivered with less than this left before its expiry (s) is counted, logged and "
        "alerted on (streams_outputs_near_expiry_total).",
    )

    # Completion callbacks (docs/callbacks.md): hints that make a job's poll due now; the saved state still comes
    # from a GET. Signed as Standard Webhooks; the endpoint is on the worker's web server (web_enabled).
    callbacks_enabled: bool = Field(
        False,
        description="Serve the provider's completion callbacks at callback_path and poll at "
        "callback_fallback_poll_interval_s between a job's callbacks.",
    )
    callback_path: str = Field(
        "/callbacks/generation",
        description="Path of the callback endpoint on the worker's web server (authenticated by signature, not by "
        "the web credentials).",
    )
    callback_secrets: SecretStr = Field(
        SecretStr(""),
        description="Space-separated Standard Webhooks secrets (whsec_<base64>) a callback may be signed with; "
        "several during a rotation (never shown).",
    )
    callback_timestamp_tolerance_s: Seconds = Field(
        300.0,
        description="Largest difference between a callback's webhook-timestamp and this worker's clock (s); "
        "further off is refused as stale.",
    )
    callback_max_body_bytes: PositiveInt = Field(
        64 * 1024, description="Largest callback body accepted, in bytes (a longer one is refused unread)."
    )
    callback_fallback_poll_interval_s: Seconds = Field(
        60.0,
        description="With callbacks on: least delay between two polls of a running job (s), so a lost callback "
        "only delays its completion by this much.",
    )
    # -- breakit: the callback body's read deadline
    callback_body_timeout_s: Annotated[float, Field(gt=0)] = Field(
        10.0,
        description="Longest time a callback's body may take to arrive, in seconds; a slower one is refused (408) "
        "and its connection closed, so a sender trickling bytes holds no handler.",
    )

    # wake-ups of the poll scheduler and the outbox relay (streams.worker.wakeup)
    wakeup_fallback_s: Seconds = Field(
        1.0,
        description="Longest the poll scheduler, and the outbox relay while not listening, sleep without a wake-up "
        "(s): a lost outbox notification, or a poll another worker scheduled sooner, waits at most this; also the "
        "most a transition waits for the relay (this worker's, or any worker's once notified).",
    )
    outbox_listen_enabled: EnvBool = Field(
        True,
        description="Wake the outbox relay on PostgreSQL notifications of outbox rows any worker committed (LISTEN "
        "on one dedicated connection per worker); off (e.g. behind PgBouncer in transaction mode): other workers' "
        "rows wait for the fallback (STREAMS_WAKEUP_FALLBACK_S).",
    )
    # -- idle: longer fallbacks where a wake-up covers the work (docs/operations.md, "Wake-ups")
    wakeup_listening_fallback_s: Seconds = Field(
        30.0,
        description="Longest the outbox relay sleeps without a wake-up while its outbox listener is connected (s): "
        "every committed outbox row notifies it then or is this worker's own (outputs within "
        "STREAMS_WAKEUP_PEER_OUTPUTS_DELAY_S, transitions within STREAMS_WAKEUP_FALLBACK_S; a stopping worker "
        "announces the transitions it leaves), so this bounds a lost notification and the transitions of a worker "
        "that died; at least STREAMS_WAKEUP_FALLBACK_S.",
    )
    wakeup_peer_outputs_delay_s: Seconds = Field(
        0.2,
        description="How long after a notification of committed outputs the outbox relay looks for them (s): the "
        "worker that wrote them wakes its own relay at once, so the others' rounds are a back-up, one per this "
        "span however many outputs commit in it; never longer than STREAMS_WAKEUP_FALLBACK_S (the shorter applies).",
    )

    # -- acks: how long one round of the outbox relay or the poll scheduler waits for Kafka's acknowledgements
    kafka_round_ack_wait_s: Annotated[float, Field(gt=0)] = Field(
        3.0,
        description="Longest the outbox relay and the poll scheduler wait for one round's Kafka acknowledgements "
        "(s), less than STREAMS_KAFKA_DELIVERY_TIMEOUT_S: a record still unacknowledged then is not sent again "
        "while in flight, its partition is skipped by the next rounds, and its row is marked once its "
        "acknowledgement comes, so a partition that stops acknowledging holds up the others at most this long.",
    )

    # -- pause: how long one Kafka request waits for a broker that stopped answering
    kafka_request_timeout_s: Seconds = Field(
        10.0,
        description="seconds one request of a producer to one broker may wait for its answer (aiokafka's "
        "request_timeout_ms; the broker's wait for acks=all too): a broker that stopped answering (frozen, its "
        "connection open) holds the partitions of that request this long, then they are sent again to the leader "
        "the metadata names; more than the brokers' broker.session.timeout.ms (9 s by default), after which a "
        "frozen follower leaves the in-sync replicas, at most STREAMS_KAFKA_DELIVERY_TIMEOUT_S",
    )
    kafka_consumer_request_timeout_s: Seconds = Field(
        90.0,
        description="seconds one request of the worker's consumer (fetch, metadata, heartbeat, join, commit) may "
        "wait for its answer (Faust's broker_request_timeout, whose default this is): a partition whose leader "
        "moved off a frozen broker is fetched from its new leader only once a metadata request answered, and "
        "aiokafka sends it to a random broker, maybe the frozen one; at least STREAMS_KAFKA_SESSION_TIMEOUT_S "
        "(Faust refuses less), and a join waits as long as the slowest member takes to rejoin",
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from None

    @model_validator(mode="after")
    def _check(self) -> Settings:
        """Refuse combinations that would break a worker at run time."""
        for name in (
            "remote_call_deadline_s",
            "redis_pool_timeout_s",
            "redis_connect_timeout_s",
            "web_snapshot_interval_s",
            "web_probe_timeout_s",
            "web_header_timeout_s",
            "clock_check_interval_s",
            "wakeup_fallback_s",
            "wakeup_peer_outputs_delay_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"STREAMS_{name.upper()} must be more than 0 seconds")
        if self.wakeup_listening_fallback_s < self.wakeup_fallback_s:
            raise ValueError(
                f"STREAMS_WAKEUP_LISTENING_FALLBACK_S ({self.wakeup_listening_fallback_s}) must be at least "
                f"STREAMS_WAKEUP_FALLBACK_S ({self.wakeup_fallback_s}): a relay that listens never needs to look "
                "for rows more often than one that does not"
            )
        if self.remote_call_deadline_s + self.lease_margin_s >= self.lease_ttl_s:
            raise ValueError(
                f"STREAMS_REMOTE_CALL_DEADLINE_S ({self.remote_call_deadline_s}) + STREAMS_LEASE_MARGIN_S "
                f"({self.lease_margin_s}) must be less than the lease TTL ({self.lease_ttl_s} s), or a remote call "
                "could outlive the lease that keeps a second call for the same job away"
            )
        post_budget_s = self.submit_retry_deadline_s + self.remote_call_deadline_s
        if self.submitting_stale_after_s <= post_budget_s:
            raise ValueError(
                f"STREAMS_SUBMITTING_STALE_AFTER_S ({self.submitting_stale_after_s}) must exceed the POST budget "
                f"({post_budget_s:.0f} s: retry deadline + remote call deadline), or a live dispatcher's operation "
                "would be reconciled to uncertain while it still waits to retry"
            )
        if self.visibility_timeout_s * 1000 < self.lease_ttl_ms:
            raise ValueError(
                "STREAMS_VISIBILITY_TIMEOUT_S must be at least the lease TTL "
                f"({self.lease_ttl_ms} ms), or a paused worker's poll returns while its lease still holds"
            )
        slowest_poll_s = self.poll_backoff_cap_s + self.lease_ttl_s
        if self.callbacks_enabled:  # the fallback interval is then the longest delay between two polls
            slowest_poll_s = max(self.poll_backoff_cap_s, self.callback_fallback_poll_interval_s) + self.lease_ttl_s
        if self.remote_running_slot_ttl_s <= slowest_poll_s:
            raise ValueError(
                f"STREAMS_REMOTE_RUNNING_SLOT_TTL_S ({self.remote_running_slot_ttl_s}) must exceed the longest delay "
                f"between two polls of a job ({slowest_poll_s:.0f} s: STREAMS_POLL_BACKOFF_CAP_S, or "
                "STREAMS_CALLBACK_FALLBACK_POLL_INTERVAL_S with callbacks on, + the lease TTL), "
                "or a running job's slot would lapse between its GETs"
            )
        if self.callbacks_enabled and not self.callback_secret_keys:
            raise ValueError("STREAMS_CALLBACKS_ENABLED needs STREAMS_CALLBACK_SECRETS (whsec_<base64> secrets)")
        if not self.callback_path.startswith("/"):
            raise ValueError(f"STREAMS_CALLBACK_PATH must begin with '/', got {self.callback_path!r}")
        refusal = _services_refusal(self)
        if refusal is not None:
            raise ValueError(refusal)
        if self.kafka_request_timeout_s > self.kafka_delivery_timeout_s:
            raise ValueError(
                f"STREAMS_KAFKA_REQUEST_TIMEOUT_S ({self.kafka_request_timeout_s}) must not exceed "
                f"STREAMS_KAFKA_DELIVERY_TIMEOUT_S ({self.kafka_delivery_timeout_s}): a record's delivery spans "
                "at least one request"
            )
        if self.kafka_consumer_request_timeout_s < self.kafka_session_timeout_s:
            raise ValueError(
                f"STREAMS_KAFKA_CONSUMER_REQUEST_TIMEOUT_S ({self.kafka_consumer_request_timeout_s}) must be at "
                f"least STREAMS_KAFKA_SESSION_TIMEOUT_S ({self.kafka_session_timeout_s}): Faust refuses a consumer "
                "whose requests time out before its session"
            )
        if self.kafka_round_ack_wait_s >= self.kafka_delivery_timeout_s:
            raise ValueError(
                f"STREAMS_KAFKA_ROUND_ACK_WAIT_S ({self.kafka_round_ack_wait_s}) must be less than "
                f"STREAMS_KAFKA_DELIVERY_TIMEOUT_S ({self.kafka_delivery_timeout_s}), or a round still waits the "
                "whole delivery timeout on a partition that stopped acknowledging"
            )
        return self

    @property
    def callback_secret_keys(self) -> tuple[bytes, ...]:
        """The HMAC keys of :attr:`callback_secrets` (the base64 after ``whsec_``, decoded), in order.

        Raises:
            ValueError: a secret is not ``whsec_`` followed by base64.
        """
        return tuple(callback_secret_key(secret) for secret in self.callback_secrets.get_secret_value().split())

    @property
    def web_allowed_host_names(self) -> frozenset[str]:
        """:attr:`web_allowed_hosts` as lower-case host names (``*`` when any host is answered)."""
        return frozenset(h.strip().lower() for h in self.web_allowed_hosts.split(",") if h.strip())

    @property
    def remote_throttled_code_set(self) -> frozenset[str]:
        """:attr:`remote_throttled_codes` as a set of error codes (compared exactly)."""
        return frozenset(c.strip() for c in self.remote_throttled_codes.split(",") if c.strip())

    @functools.cached_property
    def topics(self) -> dict[str, str]:
        """Role -> full topic name (``submissions``, ``polls``, ``outputs_delivered``, ``transitions``,
        ``dead_letter``, ``cancellations``), each with :attr:`topic_prefix` (computed once: settings are
        immutable; every event published looks its topic up here)."""
        names = {
            "submissions": TOPIC_SUBMISSIONS,
            "polls": TOPIC_POLLS,
            "outputs_delivered": TOPIC_OUTPUTS_DELIVERED,
            "transitions": TOPIC_TRANSITIONS,
            "dead_letter": TOPIC_DEAD_LETTER,
            "cancellations": TOPIC_CANCELLATIONS,
        }
        return {k: self.topic_prefix + v for k, v in names.items()}

    @property
    def lease_ttl_s(self) -> float:
        """The lease TTL in seconds."""
        return self.lease_ttl_ms / 1000.0

    @property
    def agent_slots(self) -> int:
        """Events a worker handles at once: dispatcher + observer concurrency."""
        return self.dispatcher_concurrency + self.observer_concurrency

    @property
    def http_max_connections(self) -> int:
        """Connections of the remote API client's pool: one per agent slot (a slot makes one call at a time),
        so a worker's own load never waits for a connection."""
        return self.agent_slots

    @property
    def redis_max_connections(self) -> int:
        """Connections of the Redis pool: one per agent slot, plus :data:`REDIS_SPARE_CONNECTIONS` for the poll
        scheduler's health check, the web health check and lease releases finishing in the background."""
        return self.agent_slots + REDIS_SPARE_CONNECTIONS

    def topic(self, role: str) -> str:
        """The full topic name for ``role`` (``submissions``, ``polls``, ``outputs_delivered``, ...).

        Raises:
            KeyError: an unknown role.
        """
        return self.topics[role]

    def replace(self, **changes: Any) -> Settings:
        """A validated copy with ``changes`` applied (raises :class:`ConfigError` like the constructor)."""
        return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields}, **changes})

    def to_env(self) -> dict[str, str]:
        """``STREAMS_*`` variables that reproduce these settings in a child process.

        The values are the real ones, secrets included (a child's environment is not a log): never print them.
        """
        env = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                text = value.get_secret_value()
            elif isinstance(value, bool):
                text = "true" if value else "false"
            else:
                text = str(value)
            env[ENV_PREFIX + name.upper()] = text
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``STREAMS_*`` variables (of ``environ``, default ``os.environ``) over the defaults,
        read by pydantic-settings (variable names in any case; unknown ``STREAMS_*`` variables ignored).

        Raises:
            ConfigError: a variable does not parse as its setting's type, is out of range, or the combination
                would break a worker (the message names the variable, never a secret's value).
        """
        source = os.environ if environ is None else environ
        unknown = unknown_variables(cls, source)
        if unknown:
            raise ConfigError(
                f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a setting (misspelt?): a "
                f"{ENV_PREFIX} variable that names no setting is refused, so that a misspelt security setting "
                f"never falls back to its default; unset it (the test suite's own are {TEST_ENV_PREFIX}*)"
            )
        return cls(**env_values(cls, source))


#: Hosts an ``http://`` provider URL may name with an API key without ``STREAMS_REMOTE_ALLOW_PLAIN_HTTP``.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def _pair_refusal(prefix: str, cert: str, key: str) -> str | None:
    """A client certificate needs its key and the reverse (``prefix``: the variables' common part)."""
    if bool(cert) != bool(key):
        return f"{ENV_PREFIX}{prefix}_CERT_FILE and {ENV_PREFIX}{prefix}_KEY_FILE go together (one is set, not both)"
    return None


def _services_refusal(s: Settings) -> str | None:
    """Why the security, replication and Sentinel settings contradict each other (a setting that would be
    silently ignored, or a secured connection missing a part), or None. Source: docs/production-services.md."""
    protocol = s.kafka_security_protocol
    sasl = protocol.startswith("SASL_")
    tls = protocol in ("SSL", "SASL_SSL")
    if not tls and (s.kafka_ssl_ca_file or s.kafka_ssl_cert_file or s.kafka_ssl_key_file):
        return f"STREAMS_KAFKA_SSL_* files are set but STREAMS_KAFKA_SECURITY_PROTOCOL={protocol} uses no TLS"
    oauth = s.kafka_sasl_mechanism == "OAUTHBEARER"
    has_password = bool(s.kafka_sasl_password.get_secret_value())
    if not sasl and (s.kafka_sasl_username or has_password or s.kafka_sasl_oauth_token_provider):
        return f"STREAMS_KAFKA_SASL_* credentials are set but STREAMS_KAFKA_SECURITY_PROTOCOL={protocol} uses no SASL"
    if sasl and not oauth and not (s.kafka_sasl_username and has_password):
        return (
            f"STREAMS_KAFKA_SASL_MECHANISM={s.kafka_sasl_mechanism} needs STREAMS_KAFKA_SASL_USERNAME and "
            "STREAMS_KAFKA_SASL_PASSWORD"
        )
    if sasl and oauth and not s.kafka_sasl_oauth_token_provider:
        return (
            "STREAMS_KAFKA_SASL_MECHANISM=OAUTHBEARER needs STREAMS_KAFKA_SASL_OAUTH_TOKEN_PROVIDER (module:callable)"
        )
    if s.kafka_sasl_oauth_token_provider and not oauth:
        return "STREAMS_KAFKA_SASL_OAUTH_TOKEN_PROVIDER is set but STREAMS_KAFKA_SASL_MECHANISM is not OAUTHBEARER"
    if 0 < s.kafka_replication_factor < s.kafka_min_insync_replicas:
        return (
            f"STREAMS_KAFKA_MIN_INSYNC_REPLICAS ({s.kafka_min_insync_replicas}) must not exceed "
            f"STREAMS_KAFKA_REPLICATION_FACTOR ({s.kafka_replication_factor}): no write would ever be acknowledged"
        )
    if s.kafka_delivery_timeout_s <= 0 or s.kafka_metadata_max_age_s <= 0 or s.kafka_request_timeout_s <= 0:
        return (
            "STREAMS_KAFKA_DELIVERY_TIMEOUT_S, STREAMS_KAFKA_METADATA_MAX_AGE_S and STREAMS_KAFKA_REQUEST_TIMEOUT_S "
            "must be more than 0 seconds"
        )
    for prefix, cert, key in (
        ("KAFKA_SSL", s.kafka_ssl_cert_file, s.kafka_ssl_key_file),
        ("REDIS_SSL", s.redis_ssl_cert_file, s.redis_ssl_key_file),
        ("REMOTE_CLIENT", s.remote_client_cert_file, s.remote_client_key_file),
    ):
        refusal = _pair_refusal(prefix, cert, key)
        if refusal is not None:
            return refusal
    redis_scheme = urlsplit(s.redis_url.get_secret_value()).scheme
    if redis_scheme != "rediss" and (s.redis_ssl_ca_file or s.redis_ssl_cert_file or s.redis_ssl_key_file):
        return "STREAMS_REDIS_SSL_* files are set but STREAMS_REDIS_URL is not rediss:// (TLS)"
    if bool(s.redis_sentinels) != bool(s.redis_sentinel_master):
        return "STREAMS_REDIS_SENTINELS and STREAMS_REDIS_SENTINEL_MASTER go together (one is set, not both)"
    if s.redis_sentinels:
        for address in s.redis_sentinels.split(","):
            host, _, port = address.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                return f"STREAMS_REDIS_SENTINELS holds {address.strip()!r}: write host:port,host:port,..."
    remote = urlsplit(s.remote_base_url.get_secret_value())
    if (
        remote.scheme == "http"
        and (remote.hostname or "") not in LOOPBACK_HOSTS
        and s.remote_api_key.get_secret_value()
        and not s.remote_allow_plain_http
    ):
        return (
            f"STREAMS_REMOTE_BASE_URL is http:// to {remote.hostname}: the API key would travel unencrypted; use "
            "https://, or set STREAMS_REMOTE_ALLOW_PLAIN_HTTP=true if the network is trusted"
        )
    return None


def _explain(exc: ValidationError) -> str:
    """One message per refused value, naming its variable and never a secret's value."""
    lines = []
    for error in exc.errors(include_url=False):
        name = str(error["loc"][0]) if error["loc"] else ""
        message = str(error["msg"]).removeprefix("Value error, ")
        if not name:  # a combination (model validator): its message names the variables
            lines.append(message)
            continue
        var = ENV_PREFIX + name.upper()
        if name in Settings.SECRET_FIELDS:
            lines.append(f"{var} is not valid: {message}")
            continue
        raw = error.get("input")
        if error["type"] == "at_least_one":
            lines.append(f"{var} must be at least 1 (got {raw!r})")
        elif error["type"] == "greater_than_equal" and error.get("ctx", {}).get("ge") == 0:
            lines.append(f"{var}={raw!r} must not be negative")
        elif error["type"] in ("greater_than_equal", "less_than_equal"):  # a bounded value (a port: 1-65535)
            lines.append(f"{var}={raw!r} should be {message.removeprefix('Input should be ')}")
        elif error["type"] == "extra_forbidden":
            lines.append(f"{name!r} is not a setting")
        else:
            annotation = Settings.model_fields[name].annotation
            type_name = getattr(annotation, "__name__", str(annotation))
            if error["type"] == "finite_number":
                message = "not a finite number"
            lines.append(f"{var}={raw!r} is not a valid {type_name}: {message}")
    return "; ".join(lines)


#: Where the settings reference lives in the repository (generated by :func:`settings_reference`).
SETTINGS_REFERENCE_PATH = "docs/settings.md"


def _type_text(annotation: Any) -> str:
    """A setting's type as the reference shows it: ``int``, ``float``, ``bool``, ``str``, ``secret``, or the
    values of a ``Literal``."""
    if isinstance(annotation, type) and issubclass(annotation, SecretStr):
        return "secret"
    if getattr(annotation, "__origin__", None) is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in annotation.__args__)
    return getattr(annotation, "__name__", str(annotation))


def _default_text(name: str, default: Any) -> str:
    if name in Settings.SECRET_FIELDS or isinstance(default, SecretStr):
        return "(secret)"
    if isinstance(default, bool):
        return "`true`" if default else "`false`"
    return f"`{default}`" if default != "" else "(empty)"


def settings_reference() -> str:
    """The Markdown text of ``docs/settings.md``: every field of :class:`Settings` in declaration order, with its
    environment variable, type, default (a secret's shown as ``(secret)``) and description. ``streams config
    reference`` prints it; a unit test fails when the file differs."""
    lines = [
        "# Settings reference",
        "",
        "<!-- Generated from streams/config.py by `streams config reference > docs/settings.md`; do not edit. -->",
        "",
        f"Every setting is read from its environment variable (`{ENV_PREFIX}<NAME>`, any case) over the default "
        "shown; a value that does not parse, or a combination that would break a worker, stops the command "
        "naming the variable (never a secret's value). Secrets are never shown: not here, not in a log line.",
        "",
        "| Setting | Environment variable | Type | Default | Description |",
        "|---|---|---|---|---|",
    ]
    for name, info in Settings.model_fields.items():
        description = (info.description or "").replace("|", "\\|")
        lines.append(
            f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | {_type_text(info.annotation)} | "
            f"{_default_text(name, info.default)} | {description} |"
        )
    return "\n".join(lines) + "\n"


def callback_secret_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret ``whsec_<base64>`` (docs/callbacks.md).

    Raises:
        ValueError: not ``whsec_`` followed by the base64 of a non-empty key (the message does not quote it).
    """
    try:
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if not key:
        raise ValueError("a STREAMS_CALLBACK_SECRETS secret is not whsec_<base64> of a non-empty key")
    return key


#: Segment of every rate budget key (:func:`budget_key`).
BUDGET_KEY_SEGMENT = "budget"


def budget_key(settings: Settings, kind: str, part: str) -> str:
    """The Redis key of one part (``tat``: the budget's state, ``pause``: a 429's pause, ``refund:<id>``: one
    refund given back, kept a minute so that it is given back once) of the rate budget of
    ``kind`` (``POST``, ``GET``, ``claims``) of the provider account :attr:`Settings.remote_account`.

    Shape: ``<prefix>:budget:{<account>}:<kind>:<part>``, e.g. ``app:budget:{default}:POST:tat``; the braces
    are a Redis Cluster hash tag: every key of one account's budget lives in one slot, as a script needs.
    """
    return f"{settings.lease_key_prefix}:{BUDGET_KEY_SEGMENT}:{{{settings.remote_account}}}:{kind}:{part}"


def lease_key(settings: Settings, action: str, operation_id: str) -> str:
    """The Redis key of the ``action`` lease (``observe`` or ``submit``) for one operation.

    Shape: ``<prefix>:<action>:<operation_id>``, e.g. ``app:observe:operation-42``.
    """
    return f"{settings.lease_key_prefix}:{action}:{operation_id}"
