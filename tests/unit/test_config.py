"""Settings from the environment, topic names and lease keys."""

from __future__ import annotations

import pytest

from streams.config import ExplicitSettings, Settings, lease_key, mask_url
from streams.errors import ConfigError
from streams_harness.simulator.config import SimulatorConfig

DEFAULT_TOPICS = {
    "submissions": "generation.submissions",
    "polls": "generation.polls",
    "outputs_delivered": "generation.outputs.delivered",
    "transitions": "generation.transitions",
    "dead_letter": "generation.dead-letter",
    "cancellations": "generation.cancellations",
}


def test_defaults() -> None:
    s = Settings()
    assert s.topics == DEFAULT_TOPICS
    assert s.partitions == 8
    assert s.lease_ttl_ms == 45_000
    assert s.lease_ttl_s == 45.0
    assert s.visibility_timeout_s == 60.0


def test_empty_environment_gives_defaults() -> None:
    assert Settings.from_env({}) == Settings()
    assert Settings.from_env({"UNRELATED": "1", "STREAMS_TEST_DATABASE_URL": "x", "STREAMS_ACTOR": "a"}) == Settings()


@pytest.mark.parametrize("var", ["STREAMS_NOT_A_SETTING", "STREAMS_KAFKA_SASL_PASWORD", "streams_kafka_ssl_cafile"])
def test_a_variable_that_names_no_setting_is_refused_by_name(var: str) -> None:
    with pytest.raises(ConfigError, match=f"^{var} is not a setting"):
        Settings.from_env({var: "x"})


def test_partitions_and_prefix() -> None:
    s = Settings.from_env({"STREAMS_PARTITIONS": "3", "STREAMS_TOPIC_PREFIX": "x."})
    assert s.partitions == 3
    assert s.topic_prefix == "x."
    assert s.topics == {
        "submissions": "x.generation.submissions",
        "polls": "x.generation.polls",
        "outputs_delivered": "x.generation.outputs.delivered",
        "transitions": "x.generation.transitions",
        "dead_letter": "x.generation.dead-letter",
        "cancellations": "x.generation.cancellations",
    }
    assert s.topic("polls") == "x.generation.polls"
    with pytest.raises(KeyError):
        s.topic("nope")


def test_types_are_parsed() -> None:
    s = Settings.from_env(
        {
            "STREAMS_HTTP_READ_TIMEOUT_S": "2.5",
            "STREAMS_POLL_BACKOFF_CAP_S": "12",
            "STREAMS_LEASE_TTL_MS": "30000",
            "STREAMS_REMOTE_CALL_DEADLINE_S": "15",
            "STREAMS_WEB_ENABLED": "false",
            "STREAMS_REMOTE_BASE_URL": "http://remote:9000",
            "STREAMS_REMOTE_ALLOW_PLAIN_HTTP": "true",
            "STREAMS_KAFKA_BOOTSTRAP": "k1:9092,k2:9092",
        }
    )
    assert s.http_read_timeout_s == 2.5
    assert s.poll_backoff_cap_s == 12.0 and isinstance(s.poll_backoff_cap_s, float)
    assert s.lease_ttl_ms == 30_000 and isinstance(s.lease_ttl_ms, int)
    assert s.lease_ttl_s == 30.0
    assert s.web_enabled is False
    assert s.remote_base_url.get_secret_value() == "http://remote:9000"
    assert s.kafka_bootstrap == "k1:9092,k2:9092"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), (" Yes ", True), ("ON", True), ("0", False), ("no", False), ("", False)],
)
def test_bool_parsing(raw: str, expected: bool) -> None:
    assert Settings.from_env({"STREAMS_WEB_ENABLED": raw}).web_enabled is expected


@pytest.mark.parametrize(
    ("var", "raw", "type_name"),
    [
        ("STREAMS_PARTITIONS", "three", "int"),
        ("STREAMS_PARTITIONS", "3.0", "int"),
        ("STREAMS_LEASE_TTL_MS", "", "int"),
        ("STREAMS_VISIBILITY_TIMEOUT_S", "a minute", "float"),
    ],
)
def test_bad_number_names_the_variable(var: str, raw: str, type_name: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({var: raw})
    assert str(info.value).startswith(f"{var}={raw!r} is not a valid {type_name}: ")


@pytest.mark.parametrize(("raw", "message"), [("0", "must be at least 1"), ("-1", "must not be negative")])
def test_partitions_must_be_positive(raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"STREAMS_PARTITIONS.*{message}"):
        Settings.from_env({"STREAMS_PARTITIONS": raw})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STREAMS_VISIBILITY_TIMEOUT_S": "nan"}, "not a finite number"),
        ({"STREAMS_VISIBILITY_TIMEOUT_S": "inf"}, "not a finite number"),
        ({"STREAMS_LEASE_TTL_MS": "0"}, "STREAMS_LEASE_TTL_MS must be at least 1"),
        ({"STREAMS_POLL_BATCH_SIZE": "0"}, "STREAMS_POLL_BATCH_SIZE must be at least 1"),
        ({"STREAMS_RELAY_BATCH_SIZE": "-1"}, "must not be negative"),
        ({"STREAMS_WEB_ENABLED": "flase"}, "expected one of"),
        ({"STREAMS_WEB_PORT": "0"}, "STREAMS_WEB_PORT='0' should be greater than or equal to 1"),
        ({"STREAMS_WEB_PORT": "65536"}, "STREAMS_WEB_PORT='65536' should be less than or equal to 65535"),
        ({"STREAMS_SUBMIT_RETRY_DEADLINE_S": "300"}, "must exceed the POST budget"),
        (
            {"STREAMS_WAKEUP_FALLBACK_S": "5", "STREAMS_WAKEUP_LISTENING_FALLBACK_S": "2"},
            r"STREAMS_WAKEUP_LISTENING_FALLBACK_S \(2.0\) must be at least STREAMS_WAKEUP_FALLBACK_S \(5.0\)",
        ),
        (
            {"STREAMS_HTTP_TRANSPORT": "curl"},
            "STREAMS_HTTP_TRANSPORT='curl' is not a valid Literal: Input should be 'aiohttp' or 'httpx'",
        ),
    ],
)
def test_values_that_would_break_a_worker_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.from_env(env)


@pytest.mark.parametrize(
    "env",
    [
        {"STREAMS_VISIBILITY_TIMEOUT_S": "44.999"},
        {"STREAMS_VISIBILITY_TIMEOUT_S": "10"},
        {"STREAMS_LEASE_TTL_MS": "60001"},
        {"STREAMS_LEASE_TTL_MS": "90000", "STREAMS_VISIBILITY_TIMEOUT_S": "89.9"},
    ],
)
def test_visibility_timeout_below_lease_ttl(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env)
    assert "STREAMS_VISIBILITY_TIMEOUT_S must be at least the lease TTL" in str(info.value)


@pytest.mark.parametrize(
    "env",
    [
        {"STREAMS_VISIBILITY_TIMEOUT_S": "45"},
        {"STREAMS_LEASE_TTL_MS": "60000"},
        {
            "STREAMS_LEASE_TTL_MS": "1000",
            "STREAMS_VISIBILITY_TIMEOUT_S": "1",
            "STREAMS_REMOTE_CALL_DEADLINE_S": "0.5",
            "STREAMS_LEASE_MARGIN_S": "0.2",
        },
    ],
)
def test_visibility_timeout_equal_to_lease_ttl_is_fine(env: dict[str, str]) -> None:
    Settings.from_env(env)


@pytest.mark.parametrize(
    "env",
    [
        {"STREAMS_REMOTE_CALL_DEADLINE_S": "35"},  # 35 + 10 = the 45 s TTL: no margin left
        {"STREAMS_LEASE_MARGIN_S": "15.001"},
        {"STREAMS_LEASE_TTL_MS": "30000"},  # the default 30 s deadline is then as long as the lease
        {"STREAMS_LEASE_TTL_MS": "2000", "STREAMS_REMOTE_CALL_DEADLINE_S": "1.5", "STREAMS_LEASE_MARGIN_S": "0.5"},
    ],
)
def test_remote_call_deadline_must_end_before_the_lease_by_the_margin(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env)
    assert "must be less than the lease TTL" in str(info.value)


def test_remote_call_deadline_within_the_lease_and_positive() -> None:
    s = Settings.from_env({"STREAMS_REMOTE_CALL_DEADLINE_S": "34.9"})
    assert s.remote_call_deadline_s + s.lease_margin_s < s.lease_ttl_s
    with pytest.raises(ConfigError, match="STREAMS_REMOTE_CALL_DEADLINE_S must be more than 0 seconds"):
        Settings.from_env({"STREAMS_REMOTE_CALL_DEADLINE_S": "0"})


def test_pool_sizes_are_derived_from_agent_concurrency() -> None:
    s = Settings.from_env({"STREAMS_DISPATCHER_CONCURRENCY": "10", "STREAMS_OBSERVER_CONCURRENCY": "30"})
    assert s.agent_slots == 40
    assert s.http_max_connections == 40  # one remote call per agent slot at a time
    assert s.redis_max_connections == 48  # one Redis command per slot, plus the spare connections
    assert Settings().redis_max_connections == 192 + 8


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMS_PARTITIONS", "5")
    monkeypatch.setenv("STREAMS_TOPIC_PREFIX", "env-")
    s = Settings.from_env()
    assert s.partitions == 5
    assert s.topic("dead_letter") == "env-generation.dead-letter"


def test_construction_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings and the simulator's configuration share one base: only ``from_env`` reads variables."""
    monkeypatch.setenv("STREAMS_PARTITIONS", "5")
    monkeypatch.setenv("SIM_SEED", "99")
    assert (Settings().partitions, Settings(topic_prefix="x.").partitions) == (8, 8)
    assert (SimulatorConfig().seed, SimulatorConfig(port=0).seed) == (0, 0)
    assert (Settings.from_env().partitions, SimulatorConfig.from_env().seed) == (5, 99)
    assert issubclass(Settings, ExplicitSettings) and issubclass(SimulatorConfig, ExplicitSettings)


def test_replace_recomputes_topics() -> None:
    s = Settings().replace(topic_prefix="y.", partitions=2)
    assert s.partitions == 2
    assert s.topic("submissions") == "y.generation.submissions"
    assert Settings(topic_prefix="y.").topics == s.topics


def test_lease_key() -> None:
    assert lease_key(Settings(), "observe", "operation-42") == "app:observe:operation-42"
    assert lease_key(Settings(), "submit", "conv-000001") == "app:submit:conv-000001"
    assert lease_key(Settings(lease_key_prefix="test-1"), "observe", "op") == "test-1:observe:op"
    assert lease_key(Settings.from_env({"STREAMS_LEASE_KEY_PREFIX": "p"}), "observe", "o") == "p:observe:o"


# --- secrets ---------------------------------------------------------------------------------------------------

API_KEY = "sk-live-7f3a9c2e"
DB_URL = "postgresql://streams:s3cr3t-pw@db.internal:5432/ledger"
REDIS_URL = "redis://:r3d1s-pw@cache:6379/0"
REMOTE_URL = "https://svc:h77p-pw@api.example:443/v1?api_key=q-secret&region=eu"
SECRETS = ("7f3a9c2e", "s3cr3t-pw", "r3d1s-pw", "h77p-pw", "q-secret")


def secret_settings() -> Settings:
    return Settings.from_env(
        {
            "STREAMS_REMOTE_API_KEY": API_KEY,
            "STREAMS_DATABASE_URL": DB_URL,
            "STREAMS_REDIS_URL": REDIS_URL,
            "STREAMS_REMOTE_BASE_URL": REMOTE_URL,
        }
    )


def test_secrets_are_masked_in_str_and_repr_and_kept_for_use() -> None:
    s = secret_settings()
    for shown in (str(s), repr(s), f"{s}", str(s.model_dump())):
        assert not any(secret in shown for secret in SECRETS), shown
    assert "postgresql://streams:***@db.internal:5432/ledger" in repr(s)
    assert "redis://:***@cache:6379/0" in repr(s)
    assert "https://svc:***@api.example:443/v1?api_key=***&region=eu" in repr(s)
    assert "remote_api_key=SecretStr('**********')" in repr(s)
    assert s.remote_api_key.get_secret_value() == API_KEY
    assert (s.database_url.get_secret_value(), s.redis_url.get_secret_value()) == (DB_URL, REDIS_URL)
    assert s.remote_base_url.get_secret_value() == REMOTE_URL


def test_a_child_process_gets_the_real_values() -> None:
    s = secret_settings()
    env = s.to_env()
    assert (env["STREAMS_REMOTE_API_KEY"], env["STREAMS_DATABASE_URL"]) == (API_KEY, DB_URL)
    assert Settings.from_env(env) == s
    assert s.replace(partitions=2).database_url.get_secret_value() == DB_URL


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://streams:streams@127.0.0.1:5432/streams", "postgresql://streams:***@127.0.0.1:5432/streams"),
        ("postgresql://streams@127.0.0.1/streams", "postgresql://streams@127.0.0.1/streams"),
        ("postgresql://u:p%40ss@h/d?sslmode=require&password=x", "postgresql://u:***@h/d?sslmode=require&password=***"),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("http://127.0.0.1:8900", "http://127.0.0.1:8900"),
        ("http://u:p@[::1]:8900/x", "http://u:***@[::1]:8900/x"),
        ("postgresql://u:p@h:notaport/d", "***"),
    ],
)
def test_mask_url(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_errors_about_secret_settings_do_not_show_them() -> None:
    with pytest.raises(ConfigError) as info:
        Settings(database_url=12345678)
    assert "STREAMS_DATABASE_URL is not valid" in str(info.value) and "12345678" not in str(info.value)


def test_redis_versions_the_leases_work_on() -> None:
    from streams.setup.readiness import redis_version_refusal

    assert redis_version_refusal("7.0.15") is None
    assert redis_version_refusal("7.4.1") is None
    assert redis_version_refusal("8.0.0") is None
    refusal = redis_version_refusal("6.2.14")
    assert refusal is not None and "Redis 7.0 or later is required" in refusal and "'6.2.14'" in refusal
    assert redis_version_refusal("garbage") is not None


@pytest.mark.parametrize("port", ["0", "65536"])
def test_a_worker_web_port_out_of_range_is_refused_before_anything_starts(port: str) -> None:
    from click.testing import CliRunner

    from streams.cli import main

    result = CliRunner().invoke(main, ["worker", "--web-port", port])
    assert result.exit_code == 2 and "Invalid value for '--web-port'" in result.output
    assert f"{port} is not in the range 1<=x<=65535" in result.output
