"""Every Kafka client's connection settings, built in one place: TLS, SASL, metadata age and producer delivery.

:func:`client_kwargs` gives the keyword arguments of every aiokafka client the product makes
(``AIOKafkaConsumer``, ``AIOKafkaAdminClient``, and with :func:`producer_kwargs` ``AIOKafkaProducer``);
:func:`faust_settings` gives the same for the worker's Faust app (``broker_credentials`` and the timeouts).
The settings are ``STREAMS_KAFKA_*`` (:class:`streams.config.Settings`, docs/production-services.md).

Contract:

* ``SSL``: TLS with the CA bundle ``kafka_ssl_ca_file`` (empty: the system's), the client certificate
  ``kafka_ssl_cert_file`` + ``kafka_ssl_key_file`` when set (mutual TLS), the host name checked unless
  ``kafka_ssl_check_hostname`` is false.
* ``SASL_SSL`` / ``SASL_PLAINTEXT``: SASL ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512`` with user and password,
  or ``OAUTHBEARER`` with the token provider ``kafka_sasl_oauth_token_provider`` (``module:callable``, called
  with no arguments, returning an ``aiokafka.abc.AbstractTokenProvider``); over TLS as above for ``SASL_SSL``.
* Producers are idempotent with ``acks=all``. Each request to a broker waits at most ``kafka_request_timeout_s``
  (aiokafka's ``request_timeout_ms``, Faust's ``producer_request_timeout``): a broker that stopped answering
  with its connections open (SIGSTOP, a GC pause, a VM freeze) holds the partitions of a request in flight that
  long (aiokafka mutes them until it ends), then the connection is closed and the batches go again to the leader
  the metadata names. aiokafka also takes ``request_timeout_ms`` as the batches' time to live (a batch of a
  partition without a leader fails once it is older); :func:`keep_delivery_timeout` sets that back to
  ``kafka_delivery_timeout_s`` (:func:`new_producer`, and the worker's Faust producer).
* Every client refreshes its metadata at least every ``kafka_metadata_max_age_s`` (new partitions are seen
  within it).

Raises :class:`~streams.errors.ConfigError` (exit 6) naming the variable when a file cannot be read as what it
should be or the token provider cannot be loaded: never a fallback to plaintext.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import ssl
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.conn import create_conn
from aiokafka.errors import KafkaConnectionError, KafkaError, SaslAuthenticationFailed

from streams.config import Settings
from streams.errors import ConfigError, KafkaSecurityError, error_summary


def ssl_context(
    ca_file: str, cert_file: str, key_file: str, *, check_hostname: bool, key_password: str = "", what: str
) -> ssl.SSLContext:
    """A client TLS context trusting ``ca_file`` (empty: the system's CAs) and presenting ``cert_file`` with
    ``key_file`` when given. ``what`` is the variables' common prefix (``STREAMS_KAFKA_SSL``) for the message.

    Raises:
        ConfigError: a file is missing or not a PEM certificate/key (the message names the variable and path).
    """
    try:
        context = ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{what}_CA_FILE={ca_file!r} cannot be read as a PEM CA bundle: {exc}") from None
    context.check_hostname = check_hostname
    if cert_file:
        try:
            context.load_cert_chain(cert_file, key_file or None, password=key_password or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"{what}_CERT_FILE={cert_file!r} / {what}_KEY_FILE={key_file!r} cannot be read as a PEM "
                f"certificate and its key: {error_summary(exc)}"
            ) from None
    return context


def kafka_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context of the Kafka clients, or None when ``kafka_security_protocol`` uses no TLS."""
    if settings.kafka_security_protocol not in ("SSL", "SASL_SSL"):
        return None
    return ssl_context(
        settings.kafka_ssl_ca_file,
        settings.kafka_ssl_cert_file,
        settings.kafka_ssl_key_file,
        check_hostname=settings.kafka_ssl_check_hostname,
        key_password=settings.kafka_ssl_key_password.get_secret_value(),
        what="STREAMS_KAFKA_SSL",
    )


@functools.cache
def load_token_provider(reference: str) -> Any:
    """The OAUTHBEARER token provider named ``module:callable``: the callable's result (called once per process).

    Raises:
        ConfigError: the reference is not ``module:callable``, the module or the attribute is missing, or the
            result has no ``token`` coroutine method (aiokafka's ``AbstractTokenProvider``).
    """
    module_name, colon, attribute = reference.partition(":")
    var = "STREAMS_KAFKA_SASL_OAUTH_TOKEN_PROVIDER"
    if not colon or not module_name or not attribute:
        raise ConfigError(f"{var}={reference!r} must be module:callable")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{var}={reference!r} cannot be loaded: {error_summary(exc)}") from None
    provider = factory()
    if not callable(getattr(provider, "token", None)):
        raise ConfigError(f"{var}={reference!r} returned {type(provider).__name__}, which has no token() method")
    return provider


def security_kwargs(settings: Settings) -> dict[str, Any]:
    """aiokafka's ``security_protocol``, ``ssl_context`` and ``sasl_*`` keyword arguments for ``settings``."""
    protocol = settings.kafka_security_protocol
    kwargs: dict[str, Any] = {"security_protocol": protocol}
    context = kafka_ssl_context(settings)
    if context is not None:
        kwargs["ssl_context"] = context
    if protocol.startswith("SASL_"):
        kwargs["sasl_mechanism"] = settings.kafka_sasl_mechanism
        if settings.kafka_sasl_mechanism == "OAUTHBEARER":
            kwargs["sasl_oauth_token_provider"] = load_token_provider(settings.kafka_sasl_oauth_token_provider)
        else:
            kwargs["sasl_plain_username"] = settings.kafka_sasl_username
            kwargs["sasl_plain_password"] = settings.kafka_sasl_password.get_secret_value()
    return kwargs


def client_kwargs(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of every aiokafka consumer and admin client: bootstrap servers, security, metadata age."""
    return {
        "bootstrap_servers": settings.kafka_bootstrap,
        "metadata_max_age_ms": int(settings.kafka_metadata_max_age_s * 1000),
        **security_kwargs(settings),
    }


def producer_kwargs(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of every aiokafka producer: :func:`client_kwargs`, idempotent, ``acks=all``, and the
    request timeout ``kafka_request_timeout_s`` (aiokafka's ``request_timeout_ms``). Build the producer with
    :func:`new_producer`, which keeps the batches' time to live at the delivery timeout."""
    return {
        **client_kwargs(settings),
        "acks": "all",
        "enable_idempotence": True,
        "request_timeout_ms": int(settings.kafka_request_timeout_s * 1000),
    }


def keep_delivery_timeout(producer: AIOKafkaProducer, delivery_timeout_s: float) -> AIOKafkaProducer:
    """``producer`` with its batches' time to live set to ``delivery_timeout_s`` (seconds); returns it.

    aiokafka 0.14 gives its accumulator ``request_timeout_ms`` as that time to live (``MessageAccumulator``'s
    ``batch_ttl``: a batch of a partition without a leader fails with ``NotLeaderForPartitionError`` once older;
    the idempotent producer never expires a batch otherwise, it retries it). With a request timeout shorter than
    the delivery timeout, records would fail sooner than ``kafka_delivery_timeout_s`` during a leader election.

    Raises:
        TypeError: this aiokafka has no such accumulator attribute (its layout changed: check the rule above).
    """
    accumulator = getattr(producer, "_message_accumulator", None)
    if not isinstance(getattr(accumulator, "_batch_ttl", None), float):
        raise TypeError("aiokafka's producer has no MessageAccumulator._batch_ttl: check keep_delivery_timeout")
    accumulator._batch_ttl = float(delivery_timeout_s)  # type: ignore[union-attr]
    return producer


def new_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    """An ``AIOKafkaProducer`` with :func:`producer_kwargs` (``overrides`` replace or add keyword arguments) and
    the delivery timeout ``kafka_delivery_timeout_s`` (:func:`keep_delivery_timeout`)."""
    producer = AIOKafkaProducer(**{**producer_kwargs(settings), **overrides})
    return keep_delivery_timeout(producer, settings.kafka_delivery_timeout_s)


def faust_settings(settings: Settings) -> dict[str, Any]:
    """``faust.App`` keyword arguments for the same: ``broker_credentials`` (faust's ``SSLCredentials``,
    ``SASLCredentials`` or ``OAuthCredentials``; none for PLAINTEXT), metadata ages, the producer's acks and
    request timeout (the producer must apply :func:`keep_delivery_timeout`), the consumer's request timeout;
    Faust declares no topic (``topic_allow_declare``: they are ``streams migrate``'s)."""
    from faust.auth import OAuthCredentials, SASLCredentials, SSLCredentials  # the worker's import only

    protocol = settings.kafka_security_protocol
    context = kafka_ssl_context(settings)
    credentials: Any = None
    if protocol == "SSL":
        credentials = SSLCredentials(context)
    elif protocol.startswith("SASL_"):
        if settings.kafka_sasl_mechanism == "OAUTHBEARER":
            credentials = OAuthCredentials(
                oauth_cb=load_token_provider(settings.kafka_sasl_oauth_token_provider), ssl_context=context
            )
        else:
            credentials = SASLCredentials(
                username=settings.kafka_sasl_username,
                password=settings.kafka_sasl_password.get_secret_value(),
                ssl_context=context,
                mechanism=settings.kafka_sasl_mechanism,
            )
    metadata_max_age_ms = int(settings.kafka_metadata_max_age_s * 1000)
    out: dict[str, Any] = {
        "broker_credentials": credentials,
        "consumer_metadata_max_age_ms": metadata_max_age_ms,
        "producer_metadata_max_age_ms": metadata_max_age_ms,
        "producer_acks": -1,
        # each request; the batches' time to live is set back to the delivery timeout (keep_delivery_timeout)
        "producer_request_timeout": settings.kafka_request_timeout_s,
        "broker_request_timeout": settings.kafka_consumer_request_timeout_s,
        # The topics are ``streams migrate``'s (replication and min ISR from the settings, or the broker's
        # defaults): Faust creates none, as it would with its own replication factor (it cannot pass -1).
        "topic_allow_declare": False,
    }
    if settings.kafka_replication_factor >= 1:
        out["topic_replication_factor"] = settings.kafka_replication_factor
    return out


#: Seconds :func:`diagnose` waits for each connection it tries.
DIAGNOSE_TIMEOUT_S = 5.0


async def _speaks_tls(host: str, port: int) -> bool:
    """True when ``host:port`` completes a TLS handshake (any certificate: only the protocol is asked)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        async with asyncio.timeout(DIAGNOSE_TIMEOUT_S):
            _, writer = await asyncio.open_connection(host, port, ssl=context)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def _speaks_plain_kafka(host: str, port: int) -> bool:
    """True when ``host:port`` answers a plaintext Kafka connection (ApiVersions)."""
    try:
        async with asyncio.timeout(DIAGNOSE_TIMEOUT_S):
            conn = await create_conn(host, port, security_protocol="PLAINTEXT")
    except (KafkaError, OSError, TimeoutError):
        return False
    conn.close()
    return True


async def diagnose(settings: Settings) -> str | None:
    """Why the first bootstrap server refuses this client's security settings, or None when it does not (it
    connects and logs in, or fails as an outage would: nothing listening, a timeout). One connection (and, to
    name a protocol mismatch, one probe), each within :data:`DIAGNOSE_TIMEOUT_S`; never shows a password.

    The causes: the SASL login refused; the broker's certificate not trusted (or not naming the host); a TLS
    client against a plaintext port, a plaintext client against a TLS port; a TLS port that closes the connection
    of a client without a certificate (mutual TLS).
    """
    host, _, port_text = settings.kafka_bootstrap.split(",")[0].strip().rpartition(":")
    port = int(port_text)
    protocol = settings.kafka_security_protocol
    kwargs = security_kwargs(settings)
    try:
        async with asyncio.timeout(DIAGNOSE_TIMEOUT_S):
            conn = await create_conn(host, port, **kwargs)
    except SaslAuthenticationFailed as exc:
        return (
            f"the broker refused the SASL login of user {settings.kafka_sasl_username!r} "
            f"({settings.kafka_sasl_mechanism}): {exc}"
        )
    except ssl.SSLCertVerificationError as exc:
        return (
            f"the broker's certificate is not trusted ({exc.verify_message}); check STREAMS_KAFKA_SSL_CA_FILE "
            f"({settings.kafka_ssl_ca_file or 'system CAs'}) and STREAMS_KAFKA_SSL_CHECK_HOSTNAME"
        )
    except (KafkaError, OSError, TimeoutError) as exc:
        tls = protocol in ("SSL", "SASL_SSL")
        if isinstance(exc, TimeoutError):
            return None
        if tls and await _speaks_plain_kafka(host, port):
            return f"STREAMS_KAFKA_SECURITY_PROTOCOL={protocol} uses TLS, but {host}:{port} is a plaintext listener"
        if not tls and await _speaks_tls(host, port):
            return (
                f"{host}:{port} is a TLS listener, but STREAMS_KAFKA_SECURITY_PROTOCOL={protocol}: set SSL or SASL_SSL "
                "(and STREAMS_KAFKA_SSL_CA_FILE)"
            )
        if tls and not settings.kafka_ssl_cert_file and isinstance(exc, KafkaConnectionError):
            return (
                f"{host}:{port} closed the connection after the TLS handshake: it may require a client certificate "
                "(STREAMS_KAFKA_SSL_CERT_FILE and STREAMS_KAFKA_SSL_KEY_FILE)"
            )
        return None
    conn.close()
    return None


async def raise_for_security(settings: Settings, exc: BaseException) -> None:
    """After a client failed to connect with ``exc``: raise :class:`~streams.errors.KafkaSecurityError` when
    :func:`diagnose` names a wrong security setting; return otherwise (an outage: the caller goes on as before)."""
    if not isinstance(exc, (KafkaConnectionError, OSError)):
        return
    cause = await diagnose(settings)
    if cause is not None:
        raise KafkaSecurityError(settings.kafka_bootstrap, cause) from exc
