"""The provider client's auth header and TLS settings (client construction only)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from streams.config import Settings
from streams.errors import ConfigError
from streams.remote.client import make_http_client, provider_ssl_context


@pytest.mark.parametrize(
    ("header", "scheme", "expected"),
    [("Authorization", "Bearer", "Bearer k-1"), ("x-api-key", "", "k-1"), ("Authorization", "Token", "Token k-1")],
)
async def test_the_auth_header_and_scheme_are_settings(header: str, scheme: str, expected: str) -> None:
    settings = Settings(remote_api_key="k-1", remote_auth_header=header, remote_auth_scheme=scheme)
    async with make_http_client(settings, transport=httpx.MockTransport(lambda r: httpx.Response(200))) as client:
        assert client.headers[header] == expected
        if header != "Authorization":
            assert "Authorization" not in client.headers


def test_a_header_name_with_a_space_is_refused() -> None:
    with pytest.raises(ConfigError, match="STREAMS_REMOTE_AUTH_HEADER"):
        Settings(remote_auth_header="X Api Key")


def test_the_provider_ca_file_must_be_readable(tmp_path: Path) -> None:
    assert provider_ssl_context(Settings()) is None
    with pytest.raises(ConfigError, match=r"^STREAMS_REMOTE_CA_FILE="):
        provider_ssl_context(Settings(remote_ca_file=str(tmp_path / "missing.pem")))
