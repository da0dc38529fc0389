"""A client of the REST API of Toxiproxy (github.com/Shopify/toxiproxy), the TCP fault proxy the soak and the fault
tests put between the workers and a service: a proxy per link, toxics (latency, reset connections, a black hole)
added and removed while it carries traffic. The server is started by ``scripts/toxiproxy up``."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import httpx

from streams_harness.checkout import checkout_dir
from streams_harness.fleet import free_port

#: The API's address (``scripts/toxiproxy``'s).
API = "http://127.0.0.1:8474"


class Toxiproxy:
    """Proxies and toxics through the API at ``api``. Every call raises ``httpx.HTTPError`` when the API refuses
    or does not answer, except where said."""

    def __init__(self, api: str = API) -> None:
        self.api = api

    @staticmethod
    def ensure_running() -> None:
        """Start the server unless it answers already (``scripts/toxiproxy up``: built from the Go module proxy
        on first use).

        Raises:
            subprocess.CalledProcessError: it could not be built or started.
        """
        root = checkout_dir()
        subprocess.run([str(root / "scripts" / "toxiproxy"), "up"], check=True, cwd=root)

    async def _call(self, method: str, path: str, json: Any = None) -> Any:
        async with httpx.AsyncClient(base_url=self.api, timeout=10) as client:
            answer = await client.request(method, path, json=json)
            answer.raise_for_status()
            return answer.json() if answer.content else None

    async def create(self, name: str, upstream: str) -> int:
        """Create (or replace) proxy ``name`` to ``upstream`` (``host:port``) on a free loopback port; returns it."""
        await self.delete(name)
        port = free_port()
        await self._call(
            "POST", "/proxies", {"name": name, "listen": f"127.0.0.1:{port}", "upstream": upstream, "enabled": True}
        )
        return port

    async def enable(self, name: str, enabled: bool) -> None:
        """Disabled: the listener is closed and connections are refused/reset."""
        await self._call("POST", f"/proxies/{name}", {"enabled": enabled})

    async def add_toxic(self, name: str, toxic: dict[str, Any]) -> None:
        """Add ``toxic`` (Toxiproxy's JSON: ``name``, ``type``, ``stream``, ``attributes``) to proxy ``name``."""
        await self._call("POST", f"/proxies/{name}/toxics", toxic)

    async def remove_toxic(self, name: str, toxic_name: str) -> None:
        """Remove toxic ``toxic_name`` from proxy ``name`` (nothing when it is not there)."""
        with contextlib.suppress(httpx.HTTPStatusError):
            await self._call("DELETE", f"/proxies/{name}/toxics/{toxic_name}")

    @contextlib.asynccontextmanager
    async def toxic(self, name: str, toxic: dict[str, Any]) -> AsyncIterator[None]:
        """``toxic`` on proxy ``name`` for the ``async with`` block (removed even when the block fails)."""
        await self.add_toxic(name, toxic)
        try:
            yield
        finally:
            await self.remove_toxic(name, toxic["name"])

    async def blackhole(self, name: str, on: bool) -> None:
        """On: the port accepts connections but nothing is ever answered (``timeout`` toxic, timeout 0)."""
        if on:
            await self.add_toxic(
                name, {"name": "blackhole", "type": "timeout", "stream": "upstream", "attributes": {"timeout": 0}}
            )
        else:
            await self.remove_toxic(name, "blackhole")

    async def delete(self, name: str) -> None:
        """Delete proxy ``name``; never raises (it may be gone, or the server with it)."""
        with contextlib.suppress(httpx.HTTPError):
            await self._call("DELETE", f"/proxies/{name}")
