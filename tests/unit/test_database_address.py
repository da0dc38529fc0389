"""What a PostgreSQL connection error may show of its URL: host, port and database, never a password."""

from __future__ import annotations

import asyncpg
import pytest

from streams.errors import ConfigError, DatabaseConfigError
from streams.ledger.pool import connect_config_error, database_address


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("postgresql://u:s3cret@db.example:5432/ledger", "db.example:5432/ledger"),
        ("postgresql://u:s3cret@db.example:notaport/ledger", "db.example:notaport/ledger"),
        ("postgresql://u:p@ss@db.example/ledger?password=s3cret&sslmode=require", "db.example/ledger"),
        ("postgresql://db.example/ledger", "db.example/ledger"),
    ],
)
def test_address_holds_no_user_password_or_query(url: str, address: str) -> None:
    assert database_address(url) == address


def test_a_password_echoed_by_the_client_is_masked() -> None:
    url = "postgresql://u:s3%40cret@db.example:5432/ledger"
    error = connect_config_error(url, ValueError("cannot parse postgresql://u:s3@cret@db.example (s3%40cret)"))
    assert isinstance(error, DatabaseConfigError) and isinstance(error, ConfigError)
    assert "s3@cret" not in str(error) and "s3%40cret" not in str(error)
    assert str(error).startswith("STREAMS_DATABASE_URL (db.example:5432/ledger) does not parse: ")


def test_refused_login_and_missing_database_say_what_to_fix() -> None:
    url = "postgresql://u:s3cret@db.example:5432/ledger"
    login = connect_config_error(url, asyncpg.InvalidPasswordError('password authentication failed for user "u"'))
    assert str(login) == (
        'PostgreSQL at db.example:5432/ledger refused the login: password authentication failed for user "u"; '
        "fix the user and password in STREAMS_DATABASE_URL"
    )
    missing = connect_config_error(url, asyncpg.InvalidCatalogNameError('database "ledger" does not exist'))
    assert str(missing).startswith('PostgreSQL at db.example:5432/ledger: database "ledger" does not exist; create it')
    assert login.address == missing.address == "db.example:5432/ledger"


@pytest.mark.parametrize("delimiter", ["/", "?", "#"])
def test_a_password_the_url_parser_cuts_short_shows_no_piece_of_it(delimiter: str) -> None:
    """Unencoded, the delimiter ends the user info: asyncpg reads the part before it as the port and quotes it in
    its error (``invalid literal for int() with base 10: 'hx7Qa'``), which masking the whole password missed."""
    url = f"postgresql://u:hx7Qa{delimiter}z9Lm@db.example:5432/ledger"
    error = connect_config_error(url, ValueError("invalid literal for int() with base 10: 'hx7Qa'"))
    assert "hx7Qa" not in str(error) and "z9Lm" not in str(error)
    assert str(error) == (
        "STREAMS_DATABASE_URL (db.example:5432/ledger) does not parse: its password holds an unencoded '/', '?' "
        "or '#'; percent-encode them (%2F, %3F, %23)"
    )


def test_a_url_parameter_the_client_refuses_is_named() -> None:
    url = "postgresql://u:s3cret@db.example:5432/ledger?sslmode=bogus"
    refusal = asyncpg.ClientConfigurationError("`sslmode` parameter must be one of: disable, allow, prefer")
    assert str(connect_config_error(url, refusal)) == (
        "STREAMS_DATABASE_URL (db.example:5432/ledger) is refused by the PostgreSQL client: `sslmode` parameter must "
        "be one of: disable, allow, prefer; write it as postgresql://USER:PASSWORD@HOST:PORT/DATABASE?PARAMETER=VALUE"
    )
