"""An answer too large to hold (a gzip bomb) to a POST and to a GET, over real loopback sockets: the worker's
memory stays near its idle figure and both calls are classified (docs/guarantees.md;
docs/provider-edges.md)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from tests.http_faults import GzipBomb

pytestmark = pytest.mark.integration

#: What the bomb expands to (bytes): 2 GiB of zeros, about 2 MB on the wire.
EXPANDED_BYTES = 2 << 30

#: Most the peak resident memory of the process that reads both bombs may pass its idle figure (KiB): the
#: answer limit (4 MiB by default) plus the read buffers, with room for the allocator's noise.
PEAK_MARGIN_KIB = 48 * 1024

#: Runs in a fresh interpreter (its own peak RSS): one good POST and GET (imports done, connections pooled),
#: the idle VmHWM, then a POST and a GET answered by the bomb; prints one JSON line.
CLIENT = """
import asyncio, json, sys
from streams.config import Settings
from streams.errors import RemoteError
from streams.remote.client import RemoteClient

def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

async def main(url, transport):
    client = RemoteClient.from_settings(Settings(remote_base_url=url, http_transport=transport))
    try:
        await client.submit("op-bomb", '{"input": {"prompt": "p"}}')
        await client.observe("op-bomb", "job1")
        idle = hwm_kib()
        outcomes = []
        for call in (client.submit("op-bomb", '{"input": {"prompt": "p"}}'), client.observe("op-bomb", "job1")):
            try:
                await call
                outcomes.append(["answered", ""])
            except RemoteError as exc:
                outcomes.append([type(exc).__name__, str(exc)])
        print(json.dumps({"idle_kib": idle, "peak_kib": hwm_kib(), "outcomes": outcomes}))
    finally:
        await client.aclose()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_a_gzip_bomb_leaves_memory_near_idle_and_both_calls_classified(transport: str) -> None:
    async with GzipBomb(EXPANDED_BYTES) as server:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CLIENT,
            server.url,
            transport,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(child.communicate(), timeout=120)
    assert child.returncode == 0, err.decode()[-2000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    (post_kind, post_why), (get_kind, get_why) = report["outcomes"]
    assert post_kind == "RemoteUnknownOutcomeError" and "a job may exist" in post_why
    assert "4194304 byte limit" in post_why
    assert get_kind == "RemoteTransientError" and "4194304 byte limit" in get_why
    assert report["peak_kib"] - report["idle_kib"] < PEAK_MARGIN_KIB, report
    assert server.answers == 4
