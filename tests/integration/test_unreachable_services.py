"""Every command facing a service that does not answer, run as a person runs it (the ``streams`` script in a
subprocess) against a Kafka bootstrap that refuses connections (a bound port nobody listens on): one paragraph
saying what stopped, which service and what to do, exit 5 (EXIT_UNAVAILABLE), never a traceback. ``streams run``
names the step it was in and still removes its database."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from streams.config import Settings
from streams.errors import EXIT_UNAVAILABLE
from tests.integration.operators_support import Result, streams_cli

pytestmark = pytest.mark.integration


@pytest.fixture
def refusing_bootstrap() -> Iterator[str]:
    """``127.0.0.1:PORT`` of a socket bound and not listening: every connection to it is refused (ECONNREFUSED)
    for as long as the test runs, and no other process can take the port meanwhile."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def assert_one_paragraph(result: Result, starts: str) -> str:
    """The one ``Error:`` line of ``result``'s stderr (the library's own log lines may precede it), checked: exit
    EXIT_UNAVAILABLE, no traceback, Kafka named with what to do. Returns the line."""
    assert result.exit_code == EXIT_UNAVAILABLE, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    assert result.stderr.rstrip().endswith(errors[0])
    line = errors[0]
    assert line.startswith(f"Error: {starts} stopped: Kafka did not answer: "), line
    assert "Unable to bootstrap" in line
    assert line.endswith(
        "What to do: check that the brokers of STREAMS_KAFKA_BOOTSTRAP are up (`streams ready --service kafka`), "
        "then run it again"
    ), line
    return line


COMMANDS = [
    ["migrate"],
    ["submit", "{jsonl}"],
    ["follow", "--count", "1"],
    ["teardown", "--topic-prefix", "unreachable-test.", "--dry-run"],
    ["dead-letters", "list", "--timeout-s", "3"],
    ["replay", "--rows", "1"],
]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
async def test_a_command_facing_a_refusing_kafka_exits_5_in_one_paragraph(
    migrated: Settings, refusing_bootstrap: str, tmp_path: Path, args: list[str]
) -> None:
    jsonl = tmp_path / "one.jsonl"
    jsonl.write_text('{"operation_id": "unreachable-1", "request": {"input": {"prompt": "x"}}}\n')
    settings = migrated.replace(kafka_bootstrap=refusing_bootstrap, kafka_admin_deadline_s=2.0)
    result = await streams_cli(settings, *(a.format(jsonl=jsonl) for a in args))
    name = " ".join(args[:2]) if args[0] == "dead-letters" else args[0]
    if args[0] == "dead-letters":  # its own reading error, exit 5 already before the central handler
        assert result.exit_code == EXIT_UNAVAILABLE and "Traceback" not in result.stderr, result.stderr
        return
    assert_one_paragraph(result, f"streams {name}")


async def test_a_run_against_a_refusing_kafka_exits_5_naming_its_step_and_removes_its_database(
    base_settings: Settings, refusing_bootstrap: str
) -> None:
    settings = base_settings.replace(kafka_bootstrap=refusing_bootstrap, kafka_admin_deadline_s=2.0)
    result = await streams_cli(settings, "run", "--rows", "3", "--workers", "1")
    assert_one_paragraph(result, 'streams run in step "set-up: create the run\'s topics"')
    found = re.search(r"^run database (\S+_run\d+): migrations applied", result.stdout, re.MULTILINE)
    assert found, result.stdout
    conn = await asyncpg.connect(base_settings.database_url.get_secret_value())
    try:
        assert not await conn.fetchval("SELECT count(*) FROM pg_database WHERE datname = $1", found.group(1))
    finally:
        await conn.close()


async def test_a_worker_facing_a_refusing_kafka_at_startup_exits_5_in_one_line(
    migrated: Settings, refusing_bootstrap: str
) -> None:
    # PostgreSQL and Redis answer; Kafka never does within the start-up timeout. The worker ended with Faust's
    # traceback and exit 1, which a supervisor cannot tell from a crash.
    settings = migrated.replace(kafka_bootstrap=refusing_bootstrap, startup_timeout_s=1.0, web_enabled=False)
    result = await streams_cli(settings, "--log-format", "text", "worker")
    assert result.exit_code == EXIT_UNAVAILABLE, result.stdout[-2000:]
    assert "Traceback" not in result.stderr + result.stdout
    stopped = [line for line in result.stdout.splitlines() if "streams worker stopped" in line]
    assert len(stopped) == 1, result.stdout[-2000:]
    assert f"a service did not answer: kafka: {refusing_bootstrap}" in stopped[0]
    assert "Check that the broker" in stopped[0]


#: (the command's name, its arguments)
LEDGER_COMMANDS = [
    ("operations list", []),
    ("operations show", ["unreachable-1"]),
    ("accounting report", []),
    ("purge", ["--older-than", "30d", "--dry-run"]),
]


@pytest.mark.parametrize(("name", "args"), LEDGER_COMMANDS, ids=[name for name, _ in LEDGER_COMMANDS])
async def test_an_on_call_command_facing_a_refusing_postgresql_names_itself_the_service_and_what_to_do(
    migrated: Settings, refusing_bootstrap: str, name: str, args: list[str]
) -> None:
    """The on-call commands said only "PostgreSQL unavailable during connect: ...": not which command stopped nor
    what to do, as every other command does."""
    database_url = migrated.database_url.get_secret_value()
    at = database_url.split("@", 1)[1].split("/", 1)[0]
    settings = migrated.replace(database_url=database_url.replace(at, refusing_bootstrap))
    result = await streams_cli(settings, *name.split(), *args)
    assert result.exit_code == EXIT_UNAVAILABLE, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    line = [x for x in result.stderr.splitlines() if x.startswith("Error: ")][-1]
    assert line.startswith(f"Error: streams {name} stopped: PostgreSQL did not answer: "), line
    assert line.endswith(
        "What to do: check that the server of STREAMS_DATABASE_URL is up (`streams ready --service postgres`), then "
        "run it again"
    ), line
    assert "streams:streams@" not in result.stderr  # the password stays out
