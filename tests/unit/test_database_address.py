"""What a PostgreSQL connection error may show of its URL: host, port and database, never a password."""

from __future__ import annotations

import asyncpg
import pytest

from streams.errors import ConfigError, DatabaseConfigError
from streams.ledger import connect_config_error, database_address


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
