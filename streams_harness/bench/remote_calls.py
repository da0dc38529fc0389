"""CPU per remote call of the product's :class:`~streams.remote.client.RemoteClient`, against the bundled simulator.

``python -m streams_harness.bench.remote_calls`` starts ``streams simulator`` on a free port (no faults, no GET
latency, no job duration) and, in this process, drives ``--requests`` POSTs (``RemoteClient.submit``) and then
as many GETs (``RemoteClient.observe`` of the jobs just created) with ``--concurrency`` tasks at once, ``--repeats``
times. It prints this process's CPU time (``time.process_time``: every thread, user + system) per request in
microseconds for each phase, and the median over the repeats. The simulator runs in its own process, so its
work is not counted; the figures are the client's whole cost per call: building the request, the HTTP stack,
reading and classifying the answer. ``--floor`` adds the same requests through a bare ``aiohttp.ClientSession``
(no classification, no error taxonomy): the lower bound of the HTTP engine.

``--profile PATH`` records the run with py-spy (collapsed stacks in PATH) and prints where the samples went.
On a shared machine CPU times are noisy: compare medians of several repeats, and runs made close together.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import click
import orjson

from streams.config import Settings
from streams.remote.client import RemoteClient
from streams_harness.bench.profile import Profiler, summarize
from streams_harness.fleet import free_port, start_simulator, wait_healthy

#: The provider request (JSON text) each POST carries, a short prompt as in the benchmark's submissions.
REQUEST = '{"input": {"prompt": "Write a haiku about leases and fencing tokens", "max_tokens": 16}}'

#: Simulator settings: every answer at once, no faults, one output per job.
SIM_ENV = {
    "SIM_SEED": "7",
    "SIM_QUEUE_MS": "0",
    "SIM_PREFILL_MS_PER_TOKEN": "0",
    "SIM_DECODE_MS_PER_TOKEN": "0",
    "SIM_GET_LATENCY_MS": "0",
    "SIM_MULTI_OUTPUT_RATE": "0",
}


async def _drive(n: int, concurrency: int, call: Callable[[int], Awaitable[None]]) -> tuple[float, float]:
    """Run ``call(0..n-1)`` with ``concurrency`` tasks; returns (CPU µs per call, wall seconds)."""
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            await call(i)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - cpu) * 1e6 / n, time.perf_counter() - wall


async def _client_round(client: RemoteClient, n: int, concurrency: int, tag: str) -> tuple[float, float]:
    job_ids: list[str] = [""] * n

    async def post(i: int) -> None:
        job_ids[i] = (await client.submit(f"{tag}-{i}", REQUEST)).job_id

    async def get(i: int) -> None:
        await client.observe(f"{tag}-{i}", job_ids[i])

    post_us, post_wall = await _drive(n, concurrency, post)
    get_us, get_wall = await _drive(n, concurrency, get)
    click.echo(
        f"  client  POST {post_us:7.1f} µs CPU ({post_wall:5.1f} s)  GET {get_us:7.1f} µs CPU ({get_wall:5.1f} s)"
    )
    return post_us, get_us


async def _floor_round(session: aiohttp.ClientSession, url: str, n: int, concurrency: int) -> tuple[float, float]:
    headers = {"Authorization": "Bearer dev-key", "Content-Type": "application/json"}
    body = orjson.dumps(orjson.loads(REQUEST) | {"model": "sim-1"})
    job_ids: list[str] = [""] * n

    async def post(i: int) -> None:
        async with session.post(f"{url}/v1/generations", data=body, headers=headers) as answer:
            job_ids[i] = orjson.loads(await answer.read())["id"]

    async def get(i: int) -> None:
        async with session.get(f"{url}/v1/generations/{job_ids[i]}", headers=headers) as answer:
            orjson.loads(await answer.read())

    post_us, post_wall = await _drive(n, concurrency, post)
    get_us, get_wall = await _drive(n, concurrency, get)
    click.echo(
        f"  floor   POST {post_us:7.1f} µs CPU ({post_wall:5.1f} s)  GET {get_us:7.1f} µs CPU ({get_wall:5.1f} s)"
    )
    return post_us, get_us


async def _bench(
    requests: int, concurrency: int, repeats: int, floor: bool, transport: str, profile: Path | None
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkdtemp(prefix="remote-calls-")) / "simulator.log"
    sim = start_simulator(port, log_path, SIM_ENV)
    profiler: Profiler | None = None
    try:
        await wait_healthy(f"{url}/healthz", 60, sim, log_path)
        settings = Settings(
            remote_base_url=url,
            http_transport=transport,
            dispatcher_concurrency=concurrency // 2,
            observer_concurrency=concurrency - concurrency // 2,
        )
        client = RemoteClient.from_settings(settings)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
        try:
            await _client_round(client, min(requests, 1000), concurrency, "warm")  # connections, imports, caches
            if floor:
                await _floor_round(session, url, min(requests, 1000), concurrency)
            if profile is not None:
                import os

                profiler = Profiler(os.getpid(), profile)
                profiler.start()
            results: dict[str, list[tuple[float, float]]] = {"client": [], "floor": []}
            for r in range(repeats):
                click.echo(f"repeat {r + 1}/{repeats}, {requests} requests of each kind, {concurrency} at once")
                results["client"].append(await _client_round(client, requests, concurrency, f"r{r}"))
                if floor:
                    results["floor"].append(await _floor_round(session, url, requests, concurrency))
        finally:
            await client.aclose()
            await session.close()
        for name, rows in results.items():
            if rows:
                post = statistics.median(p for p, _ in rows)
                get = statistics.median(g for _, g in rows)
                click.echo(f"median {name:6s} POST {post:7.1f} µs CPU per request   GET {get:7.1f} µs CPU per request")
    finally:
        if profiler is not None and profiler.stop() and profile is not None:
            click.echo(orjson.dumps(summarize(profile, top=25), option=orjson.OPT_INDENT_2).decode())
        sim.terminate()
        try:
            sim.wait(10)
        except subprocess.TimeoutExpired:
            sim.kill()


@click.command()
@click.option("--requests", default=20_000, show_default=True, help="POSTs, then as many GETs, per repeat.")
@click.option("--concurrency", default=64, show_default=True, help="Calls in flight at once (= pooled connections).")
@click.option("--repeats", default=3, show_default=True)
@click.option("--floor/--no-floor", default=False, show_default=True, help="Also time a bare aiohttp session.")
@click.option("--transport", type=click.Choice(["aiohttp", "httpx"]), default="aiohttp", show_default=True)
@click.option("--loop", "event_loop", type=click.Choice(["uvloop", "asyncio"]), default="uvloop", show_default=True)
@click.option("--profile", type=click.Path(path_type=Path), default=None, help="py-spy collapsed stacks to PATH.")
def main(
    requests: int, concurrency: int, repeats: int, floor: bool, transport: str, event_loop: str, profile: Path | None
) -> None:
    """CPU µs per POST and per GET of the remote client (see the module docstring)."""
    coroutine = _bench(requests, concurrency, repeats, floor, transport, profile)
    if event_loop == "uvloop":
        import uvloop

        uvloop.run(coroutine)
    else:
        asyncio.run(coroutine)


if __name__ == "__main__":
    main()
