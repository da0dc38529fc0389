"""Settings from the environment, topic names and lease keys."""

from __future__ import annotations

import pytest

from streams.config import ConfigError, Settings, lease_key

DEFAULT_TOPICS = {
    "submissions": "generation.submissions",
    "polls": "generation.polls",
    "outputs_delivered": "generation.outputs.delivered",
    "transitions": "generation.transitions",
    "dead_letter": "generation.dead-letter",
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
    assert Settings.from_env({"UNRELATED": "1", "STREAMS_NOT_A_SETTING": "x"}) == Settings()


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
            "STREAMS_WEB_ENABLED": "false",
            "STREAMS_REMOTE_BASE_URL": "http://remote:9000",
            "STREAMS_KAFKA_BOOTSTRAP": "k1:9092,k2:9092",
        }
    )
    assert s.http_read_timeout_s == 2.5
    assert s.poll_backoff_cap_s == 12.0 and isinstance(s.poll_backoff_cap_s, float)
    assert s.lease_ttl_ms == 30_000 and isinstance(s.lease_ttl_ms, int)
    assert s.lease_ttl_s == 30.0
    assert s.web_enabled is False
    assert s.remote_base_url == "http://remote:9000"
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
        ({"STREAMS_SUBMIT_RETRY_DEADLINE_S": "300"}, "must exceed the POST budget"),
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
        {"STREAMS_LEASE_TTL_MS": "1000", "STREAMS_VISIBILITY_TIMEOUT_S": "1"},
    ],
)
def test_visibility_timeout_equal_to_lease_ttl_is_fine(env: dict[str, str]) -> None:
    Settings.from_env(env)


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMS_PARTITIONS", "5")
    monkeypatch.setenv("STREAMS_TOPIC_PREFIX", "env-")
    s = Settings.from_env()
    assert s.partitions == 5
    assert s.topic("dead_letter") == "env-generation.dead-letter"


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
