"""Every command that connects to PostgreSQL, run as a person runs it (the ``streams`` script in a subprocess)
against the real server with wrong connection settings: one line naming host, port and database and what to fix,
exit 6 (a wrong setting, not an outage), never a traceback, never the password."""

from __future__ import annotations

import socket
import time
import uuid
from urllib.parse import urlsplit

import pytest

from streams.config import Settings
from tests.integration.operators_support import streams_cli

pytestmark = pytest.mark.integration

#: A password PostgreSQL refuses, distinctive enough that finding it in the output means it leaked.
WRONG_PASSWORD = "hx-wrong-pw-7Qz"

COMMANDS = [
    ["operations", "list"],
    ["operations", "show", "op-1"],
    ["accounting", "report"],
    ["migrate"],
    ["ready", "--service", "postgres", "--timeout-s", "5"],
]


def _wrong_url(settings: Settings, case: str) -> tuple[str, str]:
    """The URL of ``case`` built from the test database's, and the ``host:port/database`` it must name."""
    parts = urlsplit(settings.database_url.get_secret_value())
    user, password, host, port = parts.username, parts.password, parts.hostname, str(parts.port)
    database = parts.path.lstrip("/")
    if case == "wrong_password":
        password = WRONG_PASSWORD
    elif case == "missing_database":  # reported only to a login that succeeds: the real password
        database = f"streams_missing_{uuid.uuid4().hex[:8]}"
    elif case == "bad_sslmode":  # refused by the client before it connects (an asyncpg InterfaceError)
        url = f"postgresql://{user}:{WRONG_PASSWORD}@{host}:{port}/{database}?sslmode=bogus"
        return url, f"{host}:{port}/{database}"
    elif case == "port_out_of_range":  # parsed by asyncpg, refused by the socket's connect (OverflowError)
        password, port = WRONG_PASSWORD, "99999"
    elif case == "slash_in_password":  # the URL parser reads the password's first part as the port
        password = WRONG_PASSWORD.replace("-", "/")
    else:
        password, port = WRONG_PASSWORD, "notaport"
    return f"postgresql://{user}:{password}@{host}:{port}/{database}", f"{host}:{port}/{database}"


#: (case, what its one error line must say) for :func:`_wrong_url`; the first two are the harness runs' cases too.
CASES = [
    ("wrong_password", ["refused the login", "password authentication failed", "fix the user and password"]),
    ("missing_database", ["does not exist", "create it", "fix the database name"]),
    ("bad_port", ["does not parse", "notaport", "postgresql://USER:PASSWORD@HOST:PORT/DATABASE"]),
    ("bad_sslmode", ["refused by the PostgreSQL client", "`sslmode` parameter must be one of"]),
    ("port_out_of_range", ["does not parse", "0-65535"]),
    ("slash_in_password", ["does not parse", "password holds an unencoded '/'", "percent-encode"]),
]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
@pytest.mark.parametrize(("case", "expected"), CASES)
async def test_wrong_database_settings_exit_6_in_one_line(
    migrated: Settings, args: list[str], case: str, expected: list[str]
) -> None:
    url, address = _wrong_url(migrated, case)
    result = await streams_cli(migrated.replace(database_url=url), *args)
    assert result.exit_code == 6, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert address in lines[0]
    for text in expected:
        assert text in lines[0]
    for piece in WRONG_PASSWORD.split("-"):  # nor a piece of it (the part a URL parser read as the port)
        assert piece not in result.stderr + result.stdout


async def test_ready_fails_at_once_on_a_url_parameter_the_client_refuses(migrated: Settings) -> None:
    """asyncpg refuses ``sslmode=bogus`` with an ``InterfaceError`` (its ``ClientConfigurationError``), the class of
    a broken connection: ``streams ready`` (and a starting worker) retried it until the deadline."""
    url, address = _wrong_url(migrated, "bad_sslmode")
    started = time.monotonic()
    ready = ["ready", "--service", "postgres", "--timeout-s", "60"]
    result = await streams_cli(migrated.replace(database_url=url), *ready)
    assert result.exit_code == 6, result.stderr
    assert time.monotonic() - started < 30  # the deadline was 60 s: no attempt was retried
    assert address in result.stderr and "sslmode" in result.stderr


#: The harness's runs: each creates its run's database next to the configured one before anything else needs it.
HARNESS_COMMANDS = [
    ["run", "--rows", "5"],
    ["soak", "--rows", "5"],
    [
        "bench",
        "--workers",
        "1",
        "--partitions",
        "4",
        "--no-naive",
        "--no-procrastinate",
        "--no-floor",
        "--no-profile",
        "--paced-rate",
        "0",
    ],
]


@pytest.mark.parametrize("args", HARNESS_COMMANDS, ids=" ".join)
@pytest.mark.parametrize(("case", "expected"), CASES[:2])
async def test_harness_runs_with_wrong_database_settings_exit_6_with_one_error_line(
    migrated: Settings, args: list[str], case: str, expected: list[str]
) -> None:
    """Their progress lines come first on stdout; the error is one line on stderr, as the product's commands."""
    url, address = _wrong_url(migrated, case)
    result = await streams_cli(migrated.replace(database_url=url), *args)
    assert result.exit_code == 6, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert address in errors[0]
    for text in expected:
        assert text in errors[0]
    assert WRONG_PASSWORD not in result.stderr + result.stdout


@pytest.mark.parametrize("case", ["wrong_password", "missing_database", "bad_sslmode"])
async def test_a_worker_with_wrong_database_settings_exits_6(migrated: Settings, case: str) -> None:
    """The worker finds the settings wrong in its start-up wait: it exits as every command does (6, which a
    supervisor can be told not to restart after), not 1 as a crash; it never starts again in place."""
    url, address = _wrong_url(migrated, case)
    with socket.socket() as free:  # a port nobody listens on, for the web server it never starts
        free.bind(("127.0.0.1", 0))
        web_port = free.getsockname()[1]
    result = await streams_cli(migrated.replace(database_url=url, web_port=web_port), "worker")
    output = result.stdout + result.stderr
    assert result.exit_code == 6, output[-3000:]
    assert "DatabaseConfigError" in output and address in output
    assert "starting again" not in output
    for piece in WRONG_PASSWORD.split("-"):
        assert piece not in output
