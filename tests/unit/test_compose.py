"""compose/docker-compose.yml parses and stays consistent with the code (`docker compose config` where the
Docker client with its compose plugin exists; these machines have neither, so the file is checked here)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from streams.config import Settings

COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def test_services_are_the_three_backends_migrate_simulator_and_workers(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"postgres", "redis", "kafka", "migrate", "simulator", "worker"}
    assert compose["services"]["postgres"]["image"].startswith("postgres:")
    assert compose["services"]["redis"]["image"].startswith("redis:")
    assert compose["services"]["kafka"]["image"].startswith("apache/kafka:4.")


def test_workers_wait_for_migrations_and_use_known_settings(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    assert worker["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    known = {"STREAMS_" + f.name.upper() for f in dataclasses.fields(Settings)}
    env = worker["environment"]
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


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client")
def test_docker_compose_config_when_available() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("docker client without the compose plugin")
    subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "-q"], check=True)
