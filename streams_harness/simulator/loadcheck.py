"""Quick throughput check against a running simulator (not a test; prints numbers only).

Usage::

    python -m streams_harness.simulator --port 8900 --compression 60 &
    python -m streams_harness.simulator.loadcheck --url http://127.0.0.1:8900 --clients 200 --duration 5

Each of ``--clients`` concurrent ``httpx.AsyncClient`` loops ``POST /v1/generations``
then ``GET /v1/generations/{id}`` for ``--duration`` seconds.
"""

from __future__ import annotations

import asyncio
import ssl
import time

import click
import httpx

_BODY = {"model": "load", "input": {"prompt": " ".join(["token"] * 1000), "max_tokens": 20}}


async def _client_loop(
    url: str, index: str, stop_at: float, latencies: list[float], errors: list[str], tls: ssl.SSLContext
) -> int:
    done = 0
    async with httpx.AsyncClient(
        base_url=url,
        timeout=10.0,
        headers={"Authorization": "Bearer load"},
        limits=httpx.Limits(max_connections=1),
        verify=tls,  # one shared context: building one per client costs ~20 ms of CPU each
    ) as client:
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            body = {**_BODY, "metadata": {"client_reference": f"load-{index}-{n}"}}
            try:
                t0 = time.monotonic()
                r = await client.post("/v1/generations", json=body)
                latencies.append(time.monotonic() - t0)
                done += 1
                if r.status_code != 201:
                    errors.append(f"POST {r.status_code}")
                    continue
                t0 = time.monotonic()
                g = await client.get(f"/v1/generations/{r.json()['id']}")
                latencies.append(time.monotonic() - t0)
                done += 1
                if g.status_code != 200:
                    errors.append(f"GET {g.status_code}")
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)
    return done


async def measure(url: str, clients: int, duration_s: float) -> dict[str, float]:
    """Run the load and return ``{"requests", "seconds", "rps", "p50_ms", "p99_ms", "errors"}``."""
    latencies: list[float] = []
    errors: list[str] = []
    tls = ssl.create_default_context()
    run_id = time.time_ns()
    t0 = time.monotonic()
    stop_at = t0 + duration_s
    counts = await asyncio.gather(
        *(_client_loop(url, f"{run_id}-{i}", stop_at, latencies, errors, tls) for i in range(clients))
    )
    elapsed = time.monotonic() - t0
    latencies.sort()
    total = sum(counts)

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000.0 if latencies else 0.0

    return {
        "requests": float(total),
        "seconds": elapsed,
        "rps": total / elapsed,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "errors": float(len(errors)),
    }


@click.command()
@click.option("--url", default="http://127.0.0.1:8900", show_default=True, help="Simulator base URL.")
@click.option("--clients", default=200, show_default=True, help="Concurrent httpx clients.")
@click.option("--duration", default=5.0, show_default=True, help="Seconds of load.")
def main(url: str, clients: int, duration: float) -> None:
    """Print requests/s of POST+GET loops against a running simulator."""
    result = asyncio.run(measure(url, clients, duration))
    click.echo(
        f"{result['requests']:.0f} requests in {result['seconds']:.2f} s = {result['rps']:.0f} req/s "
        f"(p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, errors {result['errors']:.0f})"
    )


if __name__ == "__main__":
    main()
