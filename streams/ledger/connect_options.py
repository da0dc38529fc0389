"""Connecting to PostgreSQL with TLS and through PgBouncer: a TLS setting the server refuses is a wrong setting.

asyncpg reads TLS from the URL (``sslmode=require|verify-ca|verify-full``, ``sslrootcert``, ``sslcert``,
``sslkey``; docs/production-services.md). When the server refuses what the URL asks, asyncpg raises errors that
look like an outage (``ConnectionError`` "rejected SSL upgrade", ``FileNotFoundError`` for a missing
``sslrootcert``, ``ssl.SSLCertVerificationError``): :func:`connect` raises :class:`TlsSettingRefused` instead, a
``ValueError`` and so one of :data:`streams.ledger.store.CONNECT_CONFIG_ERRORS` (``DatabaseConfigError``, exit 6).

Behind PgBouncer in transaction pooling mode (1.18 keeps no prepared statements across transactions), set
``STREAMS_DATABASE_STATEMENT_CACHE_SIZE=0`` (:func:`connect_kwargs`): the ledger keeps no other session state (no
``SET``, ``LISTEN``, cursors or session advisory locks; see ``streams.ledger.pool._keep_session``).
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import parse_qs

import asyncpg

#: ``application_name`` of a worker's connections: the outbox trigger does not notify the transitions they write
#: (migrations/0019.worker-transitions.sql matches this prefix), since the worker wakes its own relay for them.
WORKER_APPLICATION_NAME = "streams-worker"
#: ``application_name`` of this package's other pools and checks (the operators' commands, the readiness check, the
#: harness); the migrations' client and one-off administration connections set none.
APPLICATION_NAME = "streams"
#: PostgreSQL keeps this many bytes of an application_name (NAMEDATALEN - 1).
APPLICATION_NAME_MAX_BYTES = 63

#: URL parameters of libpq that name a file.
TLS_FILE_PARAMETERS = ("sslrootcert", "sslcert", "sslkey")


class TlsSettingRefused(ValueError):
    """PostgreSQL (or the client) refused the URL's TLS settings; the message says which and what to fix."""


def _parameters(database_url: str) -> dict[str, str]:
    query = database_url.partition("?")[2]
    return {key: values[-1] for key, values in parse_qs(query).items()}


def tls_refusal(address: str, database_url: str, exc: BaseException) -> str | None:
    """What ``exc``, raised by a connection attempt to ``database_url`` (at ``address``, no password), says is
    wrong with its TLS settings, or None when it is not about them."""
    params = _parameters(database_url)
    sslmode = params.get("sslmode", "prefer")
    if isinstance(exc, ConnectionError) and "rejected SSL upgrade" in str(exc):
        return (
            f"PostgreSQL at {address} does not offer TLS, but STREAMS_DATABASE_URL asks for it (sslmode={sslmode}); "
            "enable ssl on the server or fix sslmode"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"PostgreSQL at {address}: its certificate is not trusted ({exc.verify_message}) with sslmode={sslmode}; "
            "fix sslrootcert (the CA that signed it) or the host name in STREAMS_DATABASE_URL"
        )
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        named = [f"{key}={params[key]}" for key in TLS_FILE_PARAMETERS if key in params]
        if named:
            return (
                f"PostgreSQL at {address}: a TLS file of STREAMS_DATABASE_URL cannot be read ({', '.join(named)}): "
                f"{exc.strerror}"
            )
    return None


async def connect(database_url: str, *args: Any, **kwargs: Any) -> asyncpg.Connection:
    """``asyncpg.connect(database_url, ...)`` (also the pool's ``connect``); a refused TLS setting raises
    :class:`TlsSettingRefused`, anything else as asyncpg raises it."""
    try:
        conn: asyncpg.Connection = await asyncpg.connect(database_url, *args, **kwargs)
    except OSError as exc:
        address = database_url.partition("://")[2].rpartition("@")[2].partition("?")[0]
        refusal = tls_refusal(address, database_url, exc)
        if refusal is not None:
            raise TlsSettingRefused(refusal) from exc
        raise
    return conn


def application_name(database_url: str, *, worker: bool) -> str:
    """The ``application_name`` of this package's connections to ``database_url``: :data:`WORKER_APPLICATION_NAME`
    for a worker's, else :data:`APPLICATION_NAME`, followed by ``/`` and the URL's own ``application_name`` when
    it names one (so an operator's name stays visible in ``pg_stat_activity``); cut to
    :data:`APPLICATION_NAME_MAX_BYTES` bytes as PostgreSQL would (the prefix always survives)."""
    base = WORKER_APPLICATION_NAME if worker else APPLICATION_NAME
    given = _parameters(database_url).get("application_name", "")
    name = f"{base}/{given}" if given else base
    return name.encode()[:APPLICATION_NAME_MAX_BYTES].decode(errors="ignore")


def connect_kwargs(database_url: str, statement_cache_size: int, *, worker: bool = False) -> dict[str, Any]:
    """asyncpg keyword arguments of the ledger's connections to ``database_url``: ``statement_cache_size``
    (``STREAMS_DATABASE_STATEMENT_CACHE_SIZE``; 0 behind PgBouncer in transaction mode) and the
    ``application_name`` (:func:`application_name`; PgBouncer passes it on to the server connection it lends)."""
    return {
        "statement_cache_size": statement_cache_size,
        "server_settings": {"application_name": application_name(database_url, worker=worker)},
    }
