"""compose/docker-compose.yml parses, resolves, and stays in step with the code and with ``scripts/services``.

Two readings of the file are checked: the YAML as written, and the model Docker Compose resolves from it
(``docker-compose -f compose/docker-compose.yml config --format json``, no engine needed). The Compose client is
built by ``scripts/compose-cli`` (``.ci/run`` does it before the tests); without it the resolved reading is skipped
locally and fails in CI (``CI`` set).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from streams.config import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
SERVICES = ROOT / "scripts" / "services"

#: Kafka settings that differ on purpose: container networking (two listeners, service names) and paths.
KAFKA_NETWORK_AND_PATHS = {
    "listeners",
    "advertised.listeners",
    "controller.quorum.voters",
    "listener.security.protocol.map",
    "inter.broker.listener.name",
    "log.dirs",
}


def compose_command() -> list[str] | None:
    """The Compose client: scripts/compose-cli's build, a `docker-compose` on PATH, or docker's compose plugin."""
    built = ROOT / ".data" / "bin" / "docker-compose"
    if built.is_file() and os.access(built, os.X_OK):
        return [str(built)]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


def resolved_model() -> dict[str, Any]:
    command = compose_command()
    if command is None:
        if os.environ.get("CI"):
            pytest.fail("no Docker Compose client in CI: .ci/run must run scripts/compose-cli before the tests")
        pytest.skip("no Docker Compose client (build one with scripts/compose-cli)")
    subprocess.run([*command, "-f", str(COMPOSE), "config", "-q"], check=True)
    out = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "--format", "json"], check=True, capture_output=True, text=True
    ).stdout
    model = json.loads(out)
    assert isinstance(model, dict)
    return model


@pytest.fixture(scope="module", params=["as written", "resolved by compose"])
def compose(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "resolved by compose":
        return resolved_model()
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def local() -> dict[str, str]:
    """``scripts/services config``: what the scripts run without Docker use."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVICES_", "KAFKA_"))}
    command = [str(SERVICES), "config", "--show-secrets"]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def test_the_services_settings_show_the_password_only_when_asked() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SERVICES_", "KAFKA_"))}
    out = subprocess.run([str(SERVICES), "config"], check=True, capture_output=True, text=True, env=env).stdout
    settings = dict(line.split("=", 1) for line in out.splitlines())
    assert settings["postgres.password"] == "***"


def published(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) of each published port, from either reading."""
    result = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            result.append((port["host_ip"], int(port["published"]), int(port["target"])))
        else:
            host_ip, host_port, target = str(port).split(":")
            result.append((host_ip, int(host_port), int(target)))
    return result


def environment(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


def test_services_are_the_three_backends_migrate_simulator_and_workers(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"postgres", "redis", "kafka", "migrate", "simulator", "worker"}
    assert compose["services"]["postgres"]["image"].startswith("postgres:")
    assert compose["services"]["redis"]["image"].startswith("redis:")
    assert compose["services"]["kafka"]["image"].startswith("apache/kafka:4.")


def test_workers_wait_for_migrations_and_use_known_settings(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    assert worker["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    known = {"STREAMS_" + name.upper() for name in Settings.model_fields}
    env = environment(worker)
    assert set(env) <= known, f"unknown settings: {set(env) - known}"
    assert env["STREAMS_KAFKA_BOOTSTRAP"] == "kafka:9092"
    migrate = compose["services"]["migrate"]["depends_on"]  # migrations and topics
    assert migrate["postgres"]["condition"] == migrate["kafka"]["condition"] == "service_healthy"


def test_commands_are_cli_commands(compose: dict[str, Any]) -> None:
    import click

    from streams.cli import main

    commands = main.list_commands(click.Context(main))
    for name in ("migrate", "simulator", "worker"):
        command = compose["services"][name]["command"]
        words = command if isinstance(command, list) else command.split()
        assert words[0] == "streams" and words[1] in commands


def test_postgres_has_the_same_port_role_databases_and_settings(compose: dict[str, Any], local: dict[str, str]) -> None:
    postgres = compose["services"]["postgres"]
    assert published(postgres) == [("127.0.0.1", int(local["postgres.port"]), 5432)]
    env = environment(postgres)
    assert (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"]) == (local["postgres.user"], local["postgres.password"])
    created = {env["POSTGRES_DB"]}
    for config in postgres.get("configs", []):
        content = compose["configs"][config["source"]]["content"]
        created |= set(re.findall(r"CREATE DATABASE (\w+) OWNER " + local["postgres.user"], content))
    assert created == set(local["postgres.databases"].split())
    command = postgres["command"]
    for setting in local["postgres.settings"].split():
        assert ["-c", setting] in [command[i : i + 2] for i in range(len(command) - 1)], setting
    workers_db = environment(compose["services"]["worker"])["STREAMS_DATABASE_URL"]
    assert workers_db == (
        f"postgresql://{local['postgres.user']}:{local['postgres.password']}@postgres:5432/{env['POSTGRES_DB']}"
    )


def test_redis_has_the_same_port_and_settings(compose: dict[str, Any], local: dict[str, str]) -> None:
    redis = compose["services"]["redis"]
    assert published(redis) == [("127.0.0.1", int(local["redis.port"]), 6379)]
    assert redis["command"] == ["redis-server", *shlex.split(local["redis.args"])]


def test_kafka_has_the_same_major_line_port_and_broker_settings(compose: dict[str, Any], local: dict[str, str]) -> None:
    kafka = compose["services"]["kafka"]
    image_version = kafka["image"].rpartition(":")[2]
    assert image_version.split(".")[0] == local["kafka.version"].split(".")[0]
    assert published(kafka)[0][:2] == ("127.0.0.1", int(local["kafka.port"]))
    env = environment(kafka)
    assert env["KAFKA_HEAP_OPTS"] == local["kafka.heap_opts"]
    wanted = {
        key.removeprefix("kafka.property."): value
        for key, value in local.items()
        if key.startswith("kafka.property.") and key.removeprefix("kafka.property.") not in KAFKA_NETWORK_AND_PATHS
    }
    # The apache/kafka image turns KAFKA_FOO_BAR into foo.bar.
    in_compose = {
        name.removeprefix("KAFKA_").lower().replace("_", "."): value
        for name, value in env.items()
        if name != "KAFKA_HEAP_OPTS"
    }
    assert {k: v for k, v in in_compose.items() if k not in KAFKA_NETWORK_AND_PATHS} == wanted


DOCKERFILE = ROOT / "compose" / "Dockerfile"


def _dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined, comments dropped), one list per ``FROM``."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def test_the_image_installs_the_locked_product_and_the_built_wheel_only() -> None:
    image = _dockerfile_stages()[-1]
    runs = " ".join(i for i in image if i.upper().startswith("RUN "))
    assert "pip install --require-hashes -r /tmp/product.lock" in runs
    assert "COPY requirements/product.lock /tmp/product.lock" in image
    assert re.search(r"pip install --no-deps /tmp/dist/\*\.whl", runs)
    assert " -e " not in runs and "harness" not in runs and "dev.lock" not in runs
    copies = [i for i in image if i.upper().startswith("COPY ")]
    assert all(c.startswith(("COPY requirements/product.lock", "COPY --from=")) for c in copies), copies
    builder = _dockerfile_stages()[0]
    assert any("pip wheel --no-deps --wheel-dir /dist ." in i for i in builder)


def test_the_image_runs_as_an_unprivileged_user() -> None:
    users = [i.split()[1] for i in _dockerfile_stages()[-1] if i.upper().startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), users


def test_workers_serve_the_network_with_probes_and_no_written_secret(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    env = environment(worker)
    assert env["STREAMS_WEB_BIND"] == "0.0.0.0"  # a container's loopback is nobody's
    assert Settings.from_env(env).web_port == 6066
    assert env["STREAMS_WEB_AUTH_TOKEN"] in ("${STREAMS_WEB_AUTH_TOKEN:-}", "")  # from the caller's environment
    assert env["STREAMS_KAFKA_BOOTSTRAP"] == "kafka:9092"  # the shared settings still apply
    probe = " ".join(worker["healthcheck"]["test"])
    assert "http://127.0.0.1:6066/readyz" in probe
    assert not worker.get("ports")  # not published on the host
