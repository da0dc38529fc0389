"""Connections to the ledger: the pool, one-off connections, and the diagnosis of a connection that fails.

A connection failure is either an outage (waited out: :class:`LedgerUnavailableError`) or a wrong setting
(:class:`DatabaseConfigError`, exit status 6); PostgreSQL's refusal of a statement's values is
:class:`LedgerDataError`. :func:`guard` maps asyncpg's errors to these for every statement of the ledger.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote

import asyncpg

from streams.errors import (
    DatabaseConfigError,
    DatabasePrivilegeError,
    LedgerDataError,
    LedgerUnavailableError,
    error_summary,
)
from streams.ledger import connect_options
from streams.outages import is_outage
from streams.wire import exactjson

log = logging.getLogger(__name__)


#: What PostgreSQL answers when it refuses a statement for the values it was given (nothing written; the same
#: values always fail): class 22 (data exception: a NUL in a text, a number out of range), class 23 (integrity
#: constraint violation) and class 54 (program limit exceeded: a value too large for an index row, e.g. an output
#: id of a few kB, or for a jsonb). :class:`LedgerDataError`; a batch holding one is run again request by request.
REFUSED_VALUES = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError, asyncpg.ProgramLimitExceededError)
#: Longest one statement on a ledger connection runs before asyncpg gives up on it (s; the pool's
#: ``command_timeout``, also the bound of a connection's close). Administration connections (:func:`connect`: a
#: ``DROP DATABASE`` of a large database) have none.
COMMAND_TIMEOUT_S = 30.0


@contextlib.asynccontextmanager
async def guard(what: str) -> AsyncIterator[None]:
    try:
        yield
    except REFUSED_VALUES as exc:
        raise LedgerDataError(f"PostgreSQL refused the values of {what}: {error_summary(exc)}") from exc
    except Exception as exc:
        if is_outage(exc):  # streams.outages: connection errors, shutdown, too many connections, timeouts
            raise LedgerUnavailableError(f"PostgreSQL unavailable during {what}: {error_summary(exc)}") from exc
        raise


def _encode_json(value: Any) -> str:
    return exactjson.dumps(value).decode()


async def _init_connection(conn: asyncpg.Connection) -> None:
    """json/jsonb codecs with every number exact (:mod:`streams.wire.exactjson`): jsonb stores numbers as
    ``numeric``, so a 2**64 written here is read back as the same int (orjson would round it to a double)."""
    for typename in ("json", "jsonb"):
        await conn.set_type_codec(typename, encoder=_encode_json, decoder=exactjson.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Pool reset hook: asyncpg already rolled back any open transaction; the ledger keeps no session state
    (no SET, LISTEN, cursors or session advisory locks), so the default reset round trip is skipped."""


async def create_pool(
    database_url: str,
    *,
    min_size: int = 2,
    max_size: int = 10,
    idle_lifetime_s: float = 60.0,
    statement_cache_size: int = 100,
    worker: bool = False,
) -> asyncpg.Pool:
    """An asyncpg pool whose connections encode/decode json and jsonb with every number exact, connected by
    :func:`streams.ledger.connect_options.connect`; a connection idle for ``idle_lifetime_s`` seconds is closed
    (0: never) and opened again when next needed; ``statement_cache_size``: 0 behind PgBouncer in transaction
    mode; ``worker``: a worker's pool, whose connections' transitions notify no other worker
    (:func:`streams.ledger.connect_options.application_name`).

    Raises:
        LedgerUnavailableError: PostgreSQL did not accept the connection.
        DatabaseConfigError: it refused the login, has no such database, or ``database_url`` does not parse.
    """
    try:
        async with guard("connect"):
            pool: asyncpg.Pool = await asyncpg.create_pool(
                database_url,
                min_size=min_size,
                max_size=max_size,
                init=_init_connection,
                reset=_keep_session,
                command_timeout=COMMAND_TIMEOUT_S,
                max_inactive_connection_lifetime=idle_lifetime_s,
                connect=connect_options.connect,
                **connect_options.connect_kwargs(database_url, statement_cache_size, worker=worker),
            )
    except CONNECT_CONFIG_ERRORS as exc:
        raise connect_config_error(database_url, exc) from exc
    return pool


async def connect(database_url: str) -> asyncpg.Connection:
    """One plain connection to ``database_url`` (no json codecs: for administration, not the ledger's rows).

    Raises:
        LedgerUnavailableError: PostgreSQL did not accept the connection.
        DatabaseConfigError: it refused the login, has no such database, or ``database_url`` does not parse.
    """
    try:
        async with guard("connect"):
            conn: asyncpg.Connection = await connect_options.connect(database_url)
    except CONNECT_CONFIG_ERRORS as exc:
        raise connect_config_error(database_url, exc) from exc
    return conn


#: What a connection attempt raises when its settings are wrong, not when the server is down: SQLSTATE class 28
#: (invalid authorization: a wrong password, an unknown role), 3D000 (no such database), and ValueError (asyncpg
#: could not parse the URL, e.g. a port that is not a number, or refused one of its parameters with
#: ``ClientConfigurationError``, e.g. ``sslmode=bogus``; :mod:`streams.outages` never counts those as outages), and
#: OverflowError (a port above 65535: asyncpg parses it, the socket's connect refuses it).
CONNECT_CONFIG_ERRORS = (
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidCatalogNameError,
    ValueError,
    OverflowError,
)

#: Seconds :func:`diagnose_connect` waits for PostgreSQL to answer a login.
DIAGNOSE_TIMEOUT_S = 5.0


def database_address(database_url: str) -> str:
    """``host:port/database`` of a PostgreSQL URL as written, without user, password or query parameters (which
    may hold a password); parses nothing, so it works on a URL that does not parse."""
    rest = database_url.partition("://")[2] or database_url
    return rest.rpartition("@")[2].partition("?")[0]


#: Characters that end the user info of a URL early when written unencoded in a password: the URL parser then
#: reads a piece of the password as the port or the path, and a client's error may quote that piece.
URL_DELIMITERS = "/?#"


def _password(database_url: str) -> str:
    """The password of a PostgreSQL URL as written (user info up to its last ``@``); empty when none."""
    userinfo = (database_url.partition("://")[2] or database_url).rpartition("@")[0]
    return userinfo.partition(":")[2]


def _without_password(text: str, database_url: str) -> str:
    """``text`` with the URL's password (user info, as written or decoded) replaced by ``***``."""
    password = _password(database_url)
    for secret in {password, unquote(password)} - {""}:
        text = text.replace(secret, "***")
    return text


def database_role_name(database_url: str) -> str | None:
    """The login role of a PostgreSQL URL as written (decoded); None when the URL names none (libpq's default)."""
    userinfo = (database_url.partition("://")[2] or database_url).rpartition("@")[0]
    return unquote(userinfo.partition(":")[0]) or None


def privilege_error(database_url: str, action: str, exc: BaseException, outcome: str) -> DatabasePrivilegeError:
    """The :class:`DatabasePrivilegeError` for ``exc``, PostgreSQL's refusal (SQLSTATE 42501) of ``action`` (what
    the command tried, e.g. ``apply the migrations``) to ``database_url``'s role: who, where (never the password),
    PostgreSQL's words, what to do, and ``outcome`` (what was left, e.g. ``nothing was applied``)."""
    role = database_role_name(database_url)
    who = f"role {role}" if role else "the login role"
    detail = _without_password(" ".join(str(exc).split()), database_url)
    return DatabasePrivilegeError(
        f"{who} may not {action} on PostgreSQL at {database_address(database_url)} ({detail}): run it as the "
        'database\'s owner (docs/operating-data.md, "Roles"); ' + outcome
    )


def connect_config_error(database_url: str, exc: BaseException) -> DatabaseConfigError:
    """The :class:`DatabaseConfigError` for ``exc``, one of :data:`CONNECT_CONFIG_ERRORS` raised by a connection
    attempt to ``database_url``: what failed, where (host, port, database; never the password) and what to fix."""
    address = database_address(database_url)
    detail = _without_password(str(exc), database_url)
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        message = (
            f"PostgreSQL at {address} refused the login: {detail}; fix the user and password in STREAMS_DATABASE_URL"
        )
    elif isinstance(exc, asyncpg.InvalidCatalogNameError):
        message = (
            f"PostgreSQL at {address}: {detail}; create it (as the database owner) or fix the database name in "
            "STREAMS_DATABASE_URL, then run streams migrate"
        )
    elif isinstance(exc, connect_options.TlsSettingRefused):
        message = _without_password(str(exc), database_url)
    elif any(char in _password(database_url) for char in URL_DELIMITERS):
        # The client's error would quote a piece of the password (the part before the delimiter, read as the
        # port): name the cause instead of echoing it.
        message = (
            f"STREAMS_DATABASE_URL ({address}) does not parse: its password holds an unencoded '/', '?' or '#'; "
            "percent-encode them (%2F, %3F, %23)"
        )
    elif isinstance(exc, asyncpg.ClientConfigurationError):
        message = (
            f"STREAMS_DATABASE_URL ({address}) is refused by the PostgreSQL client: {detail}; "
            "write it as postgresql://USER:PASSWORD@HOST:PORT/DATABASE?PARAMETER=VALUE"
        )
    else:
        message = (
            f"STREAMS_DATABASE_URL ({address}) does not parse: {detail}; "
            "write it as postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
        )
    return DatabaseConfigError(address, message)


async def diagnose_connect(database_url: str) -> DatabaseConfigError | None:
    """Log in to ``database_url`` once (at most :data:`DIAGNOSE_TIMEOUT_S`) to tell wrong settings from an outage
    after a client that does not say which (psycopg, under yoyo's migrations) failed to connect.

    Returns:
        the :class:`DatabaseConfigError` when the settings are wrong; None when the login works or failed for
        another reason (an outage: the caller reports its own error).
    """
    try:
        conn = await connect_options.connect(database_url, timeout=DIAGNOSE_TIMEOUT_S)
    except CONNECT_CONFIG_ERRORS as exc:
        return connect_config_error(database_url, exc)
    except Exception:  # an outage or anything else: not the settings' fault as far as a login can tell
        return None
    await conn.close()
    return None
