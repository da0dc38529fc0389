"""The one-line message of a statement PostgreSQL refused for the role's lack of privilege (SQLSTATE 42501)."""

from __future__ import annotations

from streams.errors import ConfigError, DatabasePrivilegeError
from streams.ledger.pool import database_role_name, privilege_error


def test_the_message_names_the_role_and_the_place_never_the_password() -> None:
    url = "postgresql://op%40night:s3cr%2Ft@db.example:5433/ledger?sslmode=require"
    error = privilege_error(url, "apply the migrations", PermissionError("permission denied for table yoyo_lock"), "x")
    assert isinstance(error, DatabasePrivilegeError) and isinstance(error, ConfigError)
    assert str(error) == (
        "role op@night may not apply the migrations on PostgreSQL at db.example:5433/ledger (permission denied for "
        'table yoyo_lock): run it as the database\'s owner (docs/operating-data.md, "Roles"); x'
    )
    assert "s3cr" not in str(error)


def test_a_url_without_a_user_names_the_login_role() -> None:
    assert database_role_name("postgresql://db.example/ledger") is None
    assert str(privilege_error("postgresql:///ledger", "drop database d", PermissionError("no"), "kept")).startswith(
        "the login role may not drop database d"
    )
