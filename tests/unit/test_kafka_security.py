"""The Kafka, Redis and provider security settings: refused combinations and the clients' keyword arguments."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
from faust.auth import OAuthCredentials, SASLCredentials, SSLCredentials

from streams.config import Settings
from streams.errors import ConfigError
from streams.kafka_security import client_kwargs, faust_settings, new_producer, producer_kwargs

SASL = {
    "kafka_security_protocol": "SASL_SSL",
    "kafka_sasl_mechanism": "SCRAM-SHA-512",
    "kafka_sasl_username": "streams",
    "kafka_sasl_password": "s3cret",
}


class TokenProvider:
    async def token(self) -> str:
        return "a-token"


def token_provider() -> TokenProvider:
    return TokenProvider()


def test_plaintext_by_default_with_bounded_metadata_age_and_delivery() -> None:
    kwargs = producer_kwargs(Settings())
    assert kwargs == {
        "bootstrap_servers": "127.0.0.1:9092",
        "metadata_max_age_ms": 30_000,
        "security_protocol": "PLAINTEXT",
        "acks": "all",
        "enable_idempotence": True,
        "request_timeout_ms": 10_000,
    }
    faust = faust_settings(Settings(kafka_request_timeout_s=12, kafka_metadata_max_age_s=7))
    assert faust == {
        "broker_credentials": None,
        "consumer_metadata_max_age_ms": 7000,
        "producer_metadata_max_age_ms": 7000,
        "producer_acks": -1,
        "producer_request_timeout": 12.0,
        "broker_request_timeout": 90.0,
        "topic_allow_declare": False,
    }
    assert faust_settings(Settings(kafka_replication_factor=3))["topic_replication_factor"] == 3


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_ssl_reaches_every_client_and_faust(mechanism: str) -> None:
    settings = Settings(**{**SASL, "kafka_sasl_mechanism": mechanism})
    kwargs = client_kwargs(settings)
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert kwargs["sasl_mechanism"] == mechanism
    assert (kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == ("streams", "s3cret")
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext) and kwargs["ssl_context"].check_hostname
    credentials = faust_settings(settings)["broker_credentials"]
    assert isinstance(credentials, SASLCredentials)
    assert (credentials.protocol.value, credentials.mechanism.value) == ("SASL_SSL", mechanism)
    assert credentials.password == "s3cret"
    assert "s3cret" not in repr(settings)


def test_mutual_tls_with_files(tmp_path: Path) -> None:
    settings = Settings(kafka_security_protocol="SSL", kafka_ssl_check_hostname=False)
    kwargs = client_kwargs(settings)
    assert kwargs["security_protocol"] == "SSL" and "sasl_mechanism" not in kwargs
    assert kwargs["ssl_context"].check_hostname is False
    assert isinstance(faust_settings(settings)["broker_credentials"], SSLCredentials)
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match=r"^STREAMS_KAFKA_SSL_CA_FILE='.*nope.pem' cannot be read"):
        client_kwargs(settings.replace(kafka_ssl_ca_file=missing))
    not_pem = tmp_path / "client.pem"
    not_pem.write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"^STREAMS_KAFKA_SSL_CERT_FILE=.* cannot be read as a PEM certificate"):
        client_kwargs(settings.replace(kafka_ssl_cert_file=str(not_pem), kafka_ssl_key_file=str(not_pem)))


def test_oauthbearer_loads_the_token_provider() -> None:
    settings = Settings(
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_mechanism="OAUTHBEARER",
        kafka_sasl_oauth_token_provider=f"{__name__}:token_provider",
    )
    kwargs = client_kwargs(settings)
    assert isinstance(kwargs["sasl_oauth_token_provider"], TokenProvider)
    credentials = faust_settings(settings)["broker_credentials"]
    assert isinstance(credentials, OAuthCredentials) and credentials.protocol.value == "SASL_PLAINTEXT"
    with pytest.raises(ConfigError, match=r"^STREAMS_KAFKA_SASL_OAUTH_TOKEN_PROVIDER='nomodule:x' cannot be loaded"):
        client_kwargs(settings.replace(kafka_sasl_oauth_token_provider="nomodule:x"))
    with pytest.raises(ConfigError, match="must be module:callable"):
        client_kwargs(settings.replace(kafka_sasl_oauth_token_provider="nocolon"))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kafka_security_protocol": "SASL_SSL"}, "needs STREAMS_KAFKA_SASL_USERNAME and STREAMS_KAFKA_SASL_PASSWORD"),
        ({**SASL, "kafka_security_protocol": "PLAINTEXT"}, "credentials are set but .*=PLAINTEXT uses no SASL"),
        ({"kafka_ssl_ca_file": "/ca.pem"}, "STREAMS_KAFKA_SSL_\\* files are set but .*=PLAINTEXT uses no TLS"),
        ({**SASL, "kafka_sasl_mechanism": "OAUTHBEARER"}, "needs STREAMS_KAFKA_SASL_OAUTH_TOKEN_PROVIDER"),
        (
            {"kafka_security_protocol": "SSL", "kafka_ssl_cert_file": "/c.pem"},
            "STREAMS_KAFKA_SSL_CERT_FILE and STREAMS_KAFKA_SSL_KEY_FILE go together",
        ),
        ({"kafka_replication_factor": 2, "kafka_min_insync_replicas": 3}, "must not exceed"),
        ({"kafka_replication_factor": 0}, "must be -1 \\(the broker's default\\) or at least 1"),
        ({"kafka_delivery_timeout_s": 0}, "must be more than 0 seconds"),
        ({"kafka_request_timeout_s": 0}, "STREAMS_KAFKA_REQUEST_TIMEOUT_S must be more than 0 seconds"),
        (
            {"kafka_consumer_request_timeout_s": 20, "kafka_session_timeout_s": 30},
            "STREAMS_KAFKA_CONSUMER_REQUEST_TIMEOUT_S \\(20.0\\) must be at least STREAMS_KAFKA_SESSION_TIMEOUT_S",
        ),
        (
            {"kafka_request_timeout_s": 31, "kafka_delivery_timeout_s": 30},
            "STREAMS_KAFKA_REQUEST_TIMEOUT_S \\(31.0\\) must not exceed STREAMS_KAFKA_DELIVERY_TIMEOUT_S \\(30.0\\)",
        ),
        ({"redis_ssl_ca_file": "/ca.pem"}, "STREAMS_REDIS_URL is not rediss://"),
        ({"redis_sentinels": "127.0.0.1:26380"}, "STREAMS_REDIS_SENTINELS and STREAMS_REDIS_SENTINEL_MASTER go"),
        ({"redis_sentinels": "127.0.0.1", "redis_sentinel_master": "m"}, "holds '127.0.0.1': write host:port"),
        ({"remote_client_key_file": "/k.pem"}, "STREAMS_REMOTE_CLIENT_CERT_FILE and STREAMS_REMOTE_CLIENT_KEY_FILE"),
        ({"remote_base_url": "http://api.example.com"}, "http:// to api.example.com: the API key would travel"),
    ],
)
def test_contradicting_settings_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings(**values)


def test_plain_http_is_allowed_on_loopback_or_when_asked() -> None:
    assert Settings(remote_base_url="http://localhost:8900").remote_allow_plain_http is False
    assert Settings(remote_base_url="http://api.example.com", remote_allow_plain_http=True)
    assert Settings(remote_base_url="https://api.example.com")


def test_secrets_are_never_in_an_error_message() -> None:
    with pytest.raises(ConfigError) as caught:
        Settings(**{**SASL, "kafka_security_protocol": "PLAINTEXT"})
    assert "s3cret" not in str(caught.value)


async def test_a_producer_times_out_each_request_but_keeps_its_batches_for_the_delivery_timeout() -> None:
    """A frozen broker holds a produce request's partitions for the request timeout (aiokafka mutes them until
    the request ends), not for the delivery timeout; a leaderless partition's batch still lives that long."""
    producer = new_producer(Settings(kafka_request_timeout_s=4, kafka_delivery_timeout_s=25), linger_ms=5)
    try:
        assert producer.client._request_timeout_ms == 4000
        assert producer._sender._request_timeout_ms == 4000  # also the broker's wait for acks=all
        assert producer._message_accumulator._batch_ttl == 25.0
        assert producer._message_accumulator._linger_time == 0.005
    finally:
        await producer.stop()


async def test_the_workers_faust_producer_times_out_each_request_and_keeps_the_delivery_timeout() -> None:
    from streams.worker.app import create_app

    app = create_app(Settings(kafka_request_timeout_s=4, kafka_delivery_timeout_s=25))
    faust_producer: Any = app.producer
    producer = faust_producer._new_producer()
    try:
        assert (producer._txn_manager is not None, producer.client._request_timeout_ms) == (True, 4000)
        assert producer._message_accumulator._batch_ttl == 25.0
    finally:
        await producer.stop()


KAFKA_CLIENTS = ("AIOKafkaConsumer", "AIOKafkaProducer", "AIOKafkaAdminClient")


def test_every_kafka_client_of_the_product_is_built_with_the_security_settings() -> None:
    """Each aiokafka client the product builds takes ``**client_kwargs(settings)`` or ``producer_kwargs``: one
    built from ``bootstrap_servers`` alone spoke PLAINTEXT to a SASL_SSL or mutual TLS cluster (the live view's lag,
    ``streams dead-letters list``/``show``/``redrive`` did, and failed there)."""
    import ast

    root = Path(__file__).resolve().parents[2] / "streams"
    bare: list[str] = []
    built = 0
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name not in KAFKA_CLIENTS:
                continue
            built += 1
            spread = [ast.get_source_segment(source, k.value) or "" for k in node.keywords if k.arg is None]
            if not any("client_kwargs" in s or "producer_kwargs" in s for s in spread):  # or a copy of them
                bare.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert built >= 8  # the scan finds the clients (a renamed import would leave nothing to check)
    assert bare == []
