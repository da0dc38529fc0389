"""Provider simulator over real loopback HTTP (aiohttp TestServer + httpx client, no mocks)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestServer

from streams.remote.client import parse_retry_after_s
from streams_harness.simulator import SimulatorConfig, get_simulator, make_app
from streams_harness.simulator.ratelimit import dated_retry_after

AUTH = {"Authorization": "Bearer test-token"}

Factory = Callable[..., Awaitable[httpx.AsyncClient]]


@pytest.fixture
async def start_sim() -> AsyncIterator[Factory]:
    """Start a simulator with ``SimulatorConfig(**overrides)``; returns an httpx client on its base URL."""
    servers: list[TestServer] = []
    clients: list[httpx.AsyncClient] = []

    async def factory(**overrides: Any) -> httpx.AsyncClient:
        overrides.setdefault("get_latency_ms", 1.0)
        overrides.setdefault("seed", 7)
        server = TestServer(make_app(SimulatorConfig(**overrides)), host="127.0.0.1", port=0)
        await server.start_server()
        servers.append(server)
        client = httpx.AsyncClient(base_url=str(server.make_url("")).rstrip("/"), timeout=5.0)
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.aclose()
    for server in servers:
        await server.close()


def _body(op: str | None = "op-1", ctx: int = 100, gen: int = 4) -> dict[str, Any]:
    """A request whose prompt is ``ctx`` tokens long, asking for ``gen`` tokens, naming client reference ``op``."""
    body: dict[str, Any] = {"model": "sim-model", "input": {"prompt": " ".join(["lease"] * ctx), "max_tokens": gen}}
    if op is not None:
        body["metadata"] = {"client_reference": op}
    return body


async def _summary(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.get("/_sim/summary")
    assert r.status_code == 200
    data: dict[str, Any] = r.json()
    return data


async def _operation(client: httpx.AsyncClient, op: str) -> dict[str, Any]:
    r = await client.get(f"/_sim/operations/{op}")
    assert r.status_code == 200
    data: dict[str, Any] = r.json()
    return data


async def _wait_for_status(
    client: httpx.AsyncClient, job_id: str, wanted: set[str], deadline_s: float = 5.0
) -> tuple[dict[str, Any], list[str]]:
    seen: list[str] = []
    deadline = time.monotonic() + deadline_s
    while True:
        r = await client.get(f"/v1/generations/{job_id}")
        assert r.status_code == 200
        assert "Retry-After" not in r.headers
        data: dict[str, Any] = r.json()
        seen.append(data["status"])
        if data["status"] in wanted:
            return data, seen
        assert time.monotonic() < deadline, f"job {job_id} stuck in {seen[-1]}"
        await asyncio.sleep(0.01)


async def test_healthz(start_sim: Factory) -> None:
    client = await start_sim()
    r = await client.get("/healthz")
    assert (r.status_code, r.json()) == (200, {"ok": True})


async def test_lifecycle_queued_running_succeeded(start_sim: Factory) -> None:
    # queue 100 ms, prefill 0 ms, decode 200 ms: total 300 ms at compression 2
    client = await start_sim(compression=2.0, multi_output_rate=0.0)
    t0 = time.time()
    r = await client.post("/v1/generations", json=_body("op-life", ctx=0, gen=16), headers=AUTH)
    assert r.status_code == 201
    created = r.json()
    assert set(created) == {"id", "status", "created_at", "poll_after_ms"}
    assert re.fullmatch(r"job_[0-9a-f]{16}", created["id"])
    assert created["status"] == "queued"
    assert t0 - 0.01 <= created["created_at"] <= time.time() + 0.01
    assert 250 <= created["poll_after_ms"] <= 300

    job_id = created["id"]
    first = (await client.get(f"/v1/generations/{job_id}")).json()
    assert first["status"] == "queued"
    assert first["started_at"] is None and first["completed_at"] is None
    assert "outputs" not in first and "error" not in first
    assert first["metadata"] == {"client_reference": "op-life"}

    running, seen_before_running = await _wait_for_status(client, job_id, {"running", "succeeded", "failed"})
    assert running["status"] == "running"
    # compare durations, not timestamps: approx's relative tolerance on a Unix time would accept ~30 minutes
    assert running["started_at"] - created["created_at"] == pytest.approx(0.1, abs=1e-6)
    assert running["completed_at"] is None
    assert 50 <= running["poll_after_ms"] <= 200

    done, seen = await _wait_for_status(client, job_id, {"succeeded", "failed"})
    assert done["status"] == "succeeded"
    assert seen[-1] == "succeeded" and "failed" not in seen
    assert done["completed_at"] - created["created_at"] == pytest.approx(0.3, abs=1e-6)
    assert time.time() >= done["completed_at"]
    assert done["outputs"] == [
        {"id": "out_0", "index": 0, "tokens": 16, "text": f"simulated output 0 of {job_id} (16 tokens)"}
    ]
    assert "error" not in done
    assert done["poll_after_ms"] == 50

    op = await _operation(client, "op-life")
    assert op["posts"] == 1 and op["post_statuses"] == [201]
    [rec] = op["jobs"]
    assert rec["job_id"] == job_id
    assert rec["status"] == rec["final_status"] == "succeeded"
    assert rec["gets"] == 1 + len(seen_before_running) + len(seen)
    assert rec["gets_in_flight"] == 0 and rec["max_gets_in_flight"] == 1
    assert rec["terminal_gets"] == 1 and rec["first_terminal_get_at"] >= rec["completed_at"]
    assert (rec["create_post_seq"], rec["create_fault"], rec["create_http_status"]) == (1, None, 201)
    assert (rec["context_tokens"], rec["generated_tokens"], rec["outputs"]) == (0, 16, 1)

    s = await _summary(client)
    assert s["jobs_created"] == 1 and s["posts"] == 1 and s["gets"] == rec["gets"]
    assert s["max_jobs_per_operation"] == 1 and s["operations_with_jobs"] == 1
    assert s["orphan_jobs_without_operation"] == 0
    assert s["max_gets_in_flight_per_job"] == 1
    assert set(s["faults_injected"].values()) == {0}


async def test_unauthorized_creates_nothing(start_sim: Factory) -> None:
    client = await start_sim()
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Basic abc"}):
        r = await client.post("/v1/generations", json=_body("op-auth"), headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "unauthorized"
    s = await _summary(client)
    assert (s["jobs_created"], s["posts"]) == (0, 3)
    assert (await _operation(client, "op-auth"))["post_statuses"] == [401, 401, 401]


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[1, 2]",
        b'{"input": {"prompt": "hi", "max_tokens": 1}}',
        b'{"model": "", "input": {"prompt": "hi", "max_tokens": 1}}',
        b'{"model": "m", "input": {"max_tokens": 1}}',
        b'{"model": "m", "input": {"prompt": "hi"}}',
        b'{"model": "m", "input": {"prompt": 7, "max_tokens": 1}}',
        b'{"model": "m", "input": {"prompt": "hi", "max_tokens": 0}}',
        b'{"model": "m", "input": {"prompt": "hi", "max_tokens": 1000001}}',
        b'{"model": "m", "input": {"prompt": "hi", "max_tokens": "1"}}',
        b'{"model": "m", "input": {"prompt": "hi", "max_tokens": true}}',
        b'{"model": "m", "input": {"prompt": "hi", "max_tokens": 1.5}}',
        b'{"model": "m", "input": {"prompt": "hi", "max_tokens": NaN}}',
        b'{"model": "m"}',
        b'{"model": "m", "input": {"prompt": "hi", "max_tokens": 1}, "metadata": "x"}',
        b'{"model": "m", "input": {"prompt": "hi", "max_tokens": 1}, "metadata": {"client_reference": 3}}',
    ],
)
async def test_invalid_body_400_creates_nothing(start_sim: Factory, content: bytes) -> None:
    client = await start_sim(fault_502_job_id=1.0)  # faults are never drawn for invalid requests
    r = await client.post("/v1/generations", content=content, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and err["message"]
    s = await _summary(client)
    assert (s["jobs_created"], s["posts"], s["faults_injected"]["upstream_502"]) == (0, 1, 0)


async def test_the_request_is_read_as_a_provider_would(start_sim: Factory) -> None:
    """Prompt length in tokens and max_tokens set the job; unknown members are ignored; numbers a double cannot
    hold are no reason to refuse; with record_bodies on, the bytes received are kept."""
    client = await start_sim(compression=1.0, record_bodies=True, multi_output_rate=0.0)
    content = (
        b'{"model": "genace-1", "input": {"prompt": "Write a haiku about leases.", "max_tokens": 32},'
        b' "seed": 18446744073709551617, "scale": 1e400, "metadata": {"client_reference": "op-haiku", "u": 1}}'
    )
    r = await client.post("/v1/generations", content=content, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    op = await _operation(client, "op-haiku")
    [rec] = op["jobs"]
    assert (rec["model"], rec["context_tokens"], rec["generated_tokens"]) == ("genace-1", 6, 32)
    assert rec["completed_at"] - rec["created_at"] == pytest.approx((200 + 6 * 0.02 + 32 * 25) / 1000)
    assert op["bodies"] == [content.decode()]
    job = (await client.get(f"/v1/generations/{rec['job_id']}")).json()
    assert (job["model"], job["metadata"]) == ("genace-1", {"client_reference": "op-haiku"})


async def test_invalid_body_naming_operation_is_counted(start_sim: Factory) -> None:
    client = await start_sim()
    r = await client.post("/v1/generations", json=_body("op-bad", gen=0), headers=AUTH)
    assert r.status_code == 400
    op = await _operation(client, "op-bad")
    assert (op["posts"], op["post_statuses"], op["jobs"]) == (1, [400], [])


async def test_429_retry_after_creates_nothing(start_sim: Factory) -> None:
    client = await start_sim(fault_429=1.0, retry_after_s=3)
    for _ in range(3):
        r = await client.post("/v1/generations", json=_body("op-429"), headers=AUTH)
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "3"
        assert r.json()["error"]["code"] == "rate_limited"
    op = await _operation(client, "op-429")
    assert (op["posts"], op["post_statuses"], op["jobs"]) == (3, [429, 429, 429], [])
    s = await _summary(client)
    assert s["jobs_created"] == 0 and s["faults_injected"]["rate_limited_429"] == 3
    assert s["operations_with_jobs"] == 0


async def test_502_carries_job_id_that_exists(start_sim: Factory) -> None:
    client = await start_sim(fault_502_job_id=1.0, compression=100.0)
    r = await client.post("/v1/generations", json=_body("op-502"), headers=AUTH)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "upstream_error" and err["job_id"].startswith("job_")
    done, _ = await _wait_for_status(client, err["job_id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded"
    op = await _operation(client, "op-502")
    assert op["post_statuses"] == [502]
    [rec] = op["jobs"]
    assert (rec["job_id"], rec["create_fault"], rec["create_http_status"]) == (err["job_id"], "upstream_502", 502)
    assert (await _summary(client))["faults_injected"]["upstream_502"] == 1


async def test_5xx_without_job_id_unknown_outcome(start_sim: Factory) -> None:
    client = await start_sim(fault_5xx=1.0)
    n = 30
    for i in range(n):
        r = await client.post("/v1/generations", json=_body(f"op-5xx-{i}"), headers=AUTH)
        assert r.status_code in (500, 503)
        err = r.json()["error"]
        assert err["code"] == "internal_error" and "job_id" not in err
    jobs = (await client.get("/_sim/jobs")).json()["jobs"]
    assert 0 < len(jobs) < n  # seeded 50/50: some created, some not
    assert all(j["create_fault"] == "internal_5xx" and j["create_http_status"] in (500, 503) for j in jobs)
    s = await _summary(client)
    assert s["faults_injected"]["internal_5xx"] == n and s["jobs_created"] == len(jobs)
    assert s["operations_with_jobs"] == len(jobs)


async def test_drop_after_create_closes_connection(start_sim: Factory) -> None:
    client = await start_sim(fault_drop_after_create=1.0)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await client.post("/v1/generations", json=_body("op-drop"), headers=AUTH)
    op = await _operation(client, "op-drop")
    assert op["post_statuses"] == [0]
    [rec] = op["jobs"]
    assert (rec["create_fault"], rec["create_http_status"]) == ("drop_after_create", 0)
    r = await client.get(f"/v1/generations/{rec['job_id']}")
    assert r.status_code == 200
    assert (await _summary(client))["faults_injected"]["drop_after_create"] == 1


async def test_slow_response_times_out_but_job_exists(start_sim: Factory) -> None:
    client = await start_sim(fault_slow=1.0, slow_response_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/generations", json=_body("op-slow"), headers=AUTH, timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    [rec] = (await _operation(client, "op-slow"))["jobs"]
    assert rec["create_fault"] == "slow_response"
    r = await client.get(f"/v1/generations/{rec['job_id']}")
    assert r.status_code == 200
    assert (await _summary(client))["faults_injected"]["slow_response"] == 1


async def test_slow_response_eventually_answers_201(start_sim: Factory) -> None:
    client = await start_sim(fault_slow=1.0, slow_response_s=0.3)
    t0 = time.monotonic()
    r = await client.post("/v1/generations", json=_body("op-slow-ok"), headers=AUTH)
    assert r.status_code == 201
    assert time.monotonic() - t0 >= 0.3
    [rec] = (await _operation(client, "op-slow-ok"))["jobs"]
    assert rec["job_id"] == r.json()["id"]


async def test_job_failed_and_multi_output(start_sim: Factory) -> None:
    client = await start_sim(fault_job_failed=1.0, compression=100.0)
    job_id = (await client.post("/v1/generations", json=_body("op-fail"), headers=AUTH)).json()["id"]
    done, _ = await _wait_for_status(client, job_id, {"succeeded", "failed"})
    assert done["status"] == "failed"
    assert done["error"]["code"] == "generation_failed"
    assert "outputs" not in done and done["completed_at"] is not None
    assert (await _summary(client))["faults_injected"]["job_failed"] == 1

    await client.post("/_sim/config", json={"fault_job_failed": 0.0, "multi_output_rate": 1.0})
    job_id = (await client.post("/v1/generations", json=_body("op-multi", gen=3), headers=AUTH)).json()["id"]
    done, _ = await _wait_for_status(client, job_id, {"succeeded", "failed"})
    assert done["status"] == "succeeded"
    assert [(o["id"], o["index"], o["tokens"]) for o in done["outputs"]] == [("out_0", 0, 3), ("out_1", 1, 3)]


async def test_unknown_job_404(start_sim: Factory) -> None:
    client = await start_sim()
    r = await client.get("/v1/generations/job_doesnotexist")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"
    s = await _summary(client)
    assert (s["gets"], s["gets_not_found"]) == (1, 1)


async def test_orphan_job_without_operation(start_sim: Factory) -> None:
    client = await start_sim()
    r = await client.post("/v1/generations", json=_body(None), headers=AUTH)
    assert r.status_code == 201
    s = await _summary(client)
    assert (s["jobs_created"], s["orphan_jobs_without_operation"], s["operations_with_jobs"]) == (1, 1, 0)
    [rec] = (await client.get("/_sim/jobs")).json()["jobs"]
    assert rec["client_reference"] is None


async def test_overlapping_gets_are_counted(start_sim: Factory) -> None:
    client = await start_sim(get_latency_ms=500.0)
    a = (await client.post("/v1/generations", json=_body("op-a"), headers=AUTH)).json()["id"]
    b = (await client.post("/v1/generations", json=_body("op-b"), headers=AUTH)).json()["id"]

    r1, r2 = await asyncio.gather(client.get(f"/v1/generations/{a}"), client.get(f"/v1/generations/{a}"))
    assert r1.status_code == r2.status_code == 200
    await client.get(f"/v1/generations/{b}")
    await client.get(f"/v1/generations/{b}")

    recs = {r["job_id"]: r for r in (await client.get("/_sim/jobs")).json()["jobs"]}
    assert (recs[a]["gets"], recs[a]["max_gets_in_flight"], recs[a]["gets_in_flight"]) == (2, 2, 0)
    assert (recs[b]["gets"], recs[b]["max_gets_in_flight"], recs[b]["gets_in_flight"]) == (2, 1, 0)
    assert (await _summary(client))["max_gets_in_flight_per_job"] == 2


async def test_several_jobs_per_operation(start_sim: Factory) -> None:
    client = await start_sim()
    for _ in range(3):
        await client.post("/v1/generations", json=_body("op-dup"), headers=AUTH)
    await client.post("/v1/generations", json=_body("op-single"), headers=AUTH)
    op = await _operation(client, "op-dup")
    assert op["posts"] == 3 and len(op["jobs"]) == 3
    s = await _summary(client)
    assert (s["max_jobs_per_operation"], s["operations_with_jobs"], s["posts"]) == (3, 2, 4)
    assert await _operation(client, "op-never") == {"posts": 0, "post_statuses": [], "jobs": [], "bodies": []}


async def test_runtime_config_and_reset(start_sim: Factory) -> None:
    client = await start_sim()
    r = await client.post("/_sim/config", json={"fault_429": 1, "retry_after_s": 2})
    assert r.status_code == 200
    cfg = r.json()
    assert (cfg["fault_429"], cfg["retry_after_s"], cfg["seed"], cfg["get_latency_ms"]) == (1.0, 2, 7, 1.0)
    r = await client.post("/v1/generations", json=_body("op-cfg"), headers=AUTH)
    assert (r.status_code, r.headers["Retry-After"]) == (429, "2")

    for bad in ({"fault_429": 2}, {"nope": 1}, {"port": 1}, {"fault_429": "x"}):
        r = await client.post("/_sim/config", json=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = await client.post("/_sim/config", content=b"nope")
    assert r.status_code == 400

    await client.post("/_sim/config", json={"fault_429": 0})
    job_id = (await client.post("/v1/generations", json=_body("op-cfg"), headers=AUTH)).json()["id"]
    assert (await _summary(client))["posts"] == 2

    r = await client.post("/_sim/reset")
    assert (r.status_code, r.json()) == (200, {"ok": True})
    s = await _summary(client)
    assert (s["jobs_created"], s["posts"], s["gets"], s["operations_seen"]) == (0, 0, 0, 0)
    assert set(s["faults_injected"].values()) == {0}
    assert (await client.get(f"/v1/generations/{job_id}")).status_code == 404
    assert (await client.get("/_sim/jobs")).json() == {"jobs": []}


async def test_same_seed_same_fault_sequence(start_sim: Factory) -> None:
    async def statuses(client: httpx.AsyncClient) -> list[int]:
        out = []
        for i in range(40):
            r = await client.post("/v1/generations", json=_body(f"op-{i}"), headers=AUTH)
            out.append(r.status_code)
        return out

    rates = {"fault_429": 0.3, "fault_502_job_id": 0.3, "fault_5xx": 0.3}
    first = await statuses(await start_sim(seed=11, **rates))
    second = await statuses(await start_sim(seed=11, **rates))
    assert first == second
    assert {429, 502, 201} <= set(first)


async def test_app_state_is_reachable(start_sim: Factory) -> None:
    app = make_app(SimulatorConfig(seed=3))
    assert get_simulator(app).config.seed == 3


def test_cli_process_logs_address_and_serves() -> None:
    env = {**os.environ, "SIM_FAULT_429": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streams_harness.simulator", "--port", "0", "--seed", "7", "--compression", "60"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert m, line
        base = m.group(1)
        with httpx.Client(base_url=base, timeout=5.0) as client:
            assert client.get("/healthz").json() == {"ok": True}
            cfg = client.post("/_sim/config", json={}).json()
            assert (cfg["seed"], cfg["compression"], cfg["fault_429"]) == (7, 60.0, 1.0)
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


# --- GET-side faults, lookup by client reference, charges and refunds -----------------------------------------


def _ref_body(op: str, ref: str | None = None, gen: int = 4) -> dict[str, Any]:
    body = _body(op, gen=gen)
    body["metadata"]["client_reference"] = ref or op
    return body


async def test_not_found_window_answers_404_then_the_job(start_sim: Factory) -> None:
    client = await start_sim(fault_not_found=1.0, not_found_window_s=0.3, compression=100.0)
    job_id = (await client.post("/v1/generations", json=_ref_body("op-nf"), headers=AUTH)).json()["id"]
    r = await client.get(f"/v1/generations/{job_id}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    await asyncio.sleep(0.35)  # the 0.3 s window must really pass (polling it would add GETs to the count below)
    r = await client.get(f"/v1/generations/{job_id}")
    assert r.status_code == 200
    [job] = (await _operation(client, "op-nf"))["jobs"]
    assert (job["gets"], job["gets_not_found"], job["faults"]) == (2, 1, ["not_found_window"])
    assert (await _summary(client))["faults_injected"]["not_found_window"] == 1


async def test_unknown_status_is_answered_to_every_get(start_sim: Factory) -> None:
    client = await start_sim(fault_unknown_status=1.0, compression=1000.0, seed=3)
    answered = set()
    for i in range(6):
        job_id = (await client.post("/v1/generations", json=_ref_body(f"op-u{i}"), headers=AUTH)).json()["id"]
        await asyncio.sleep(0.05)  # past completion at 1000x: the job would be terminal
        statuses = {(await client.get(f"/v1/generations/{job_id}")).json()["status"] for _ in range(3)}
        [job] = (await _operation(client, f"op-u{i}"))["jobs"]
        assert statuses == {job["unknown_status"]}
        answered |= statuses
    assert answered <= {"aborted", "paused", None} and len(answered) >= 2


async def test_never_finishes_stays_running(start_sim: Factory) -> None:
    client = await start_sim(fault_never_finishes=1.0, compression=1000.0)
    job_id = (await client.post("/v1/generations", json=_ref_body("op-nv"), headers=AUTH)).json()["id"]
    await asyncio.sleep(0.1)  # its schedule ended long ago at 1000x
    data = (await client.get(f"/v1/generations/{job_id}")).json()
    assert data["status"] == "running" and data["completed_at"] is None and "charge" not in data


async def test_status_regression_answers_queued_while_running_never_after_the_end(start_sim: Factory) -> None:
    # a running window long enough (~0.5 s with gen=40 at 2x) for several GETs even on a loaded machine
    client = await start_sim(fault_status_regression=1.0, compression=2.0)
    job_id = (await client.post("/v1/generations", json=_ref_body("op-rg", gen=40), headers=AUTH)).json()["id"]
    done, seen = await _wait_for_status(client, job_id, {"succeeded"}, deadline_s=30.0)
    first_running = seen.index("running")
    assert "queued" in seen[first_running:]  # went back
    assert done["status"] == "succeeded"
    [job] = (await _operation(client, "op-rg"))["jobs"]
    assert job["regressed_gets"] >= seen[first_running:].count("queued") >= 1


async def test_new_faults_off_leave_the_fault_sequence_of_a_seed_unchanged(start_sim: Factory) -> None:
    async def statuses(client: httpx.AsyncClient) -> list[int]:
        return [
            (await client.post("/v1/generations", json=_body(f"op-{i}"), headers=AUTH)).status_code for i in range(30)
        ]

    rates = {"fault_429": 0.3, "fault_502_job_id": 0.3, "fault_job_failed": 0.5}
    plain = await statuses(await start_sim(seed=5, **rates))
    with_zero = await statuses(await start_sim(seed=5, fault_not_found=0.0, fault_unknown_status=0.0, **rates))
    assert plain == with_zero


async def test_lookup_is_off_by_default(start_sim: Factory) -> None:
    client = await start_sim()
    await client.post("/v1/generations", json=_ref_body("op-l"), headers=AUTH)
    r = await client.get("/v1/generations", params={"client_reference": "op-l"}, headers=AUTH)
    assert r.status_code == 404
    assert (await _summary(client))["lookups"] == 0


async def test_lookup_lists_jobs_by_client_reference_after_the_lag(start_sim: Factory) -> None:
    client = await start_sim(lookup_enabled=True, lookup_lag_s=0.3, compression=100.0)
    first = (await client.post("/v1/generations", json=_ref_body("op-a", "ref-1"), headers=AUTH)).json()["id"]
    second = (await client.post("/v1/generations", json=_ref_body("op-b", "ref-1"), headers=AUTH)).json()["id"]
    await client.post("/v1/generations", json=_ref_body("op-c", "ref-2"), headers=AUTH)
    r = await client.get("/v1/generations", params={"client_reference": "ref-1"}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"data": []}  # inside the consistency lag
    await asyncio.sleep(0.35)  # the 0.3 s lag must really pass (polling it would add lookups to the count below)
    data = (await client.get("/v1/generations", params={"client_reference": "ref-1"}, headers=AUTH)).json()["data"]
    assert [d["id"] for d in data] == [first, second]
    assert all(d["status"] in ("queued", "running", "succeeded") and d["created_at"] > 0 for d in data)
    r = await client.get("/v1/generations", headers=AUTH)
    assert r.status_code == 400
    assert (await _summary(client))["lookups"] == 2


async def test_charge_on_completion_and_refund_for_failed_jobs(start_sim: Factory) -> None:
    client = await start_sim(compression=100.0, price_per_context_token="0.000001", price_per_generated_token="0.01")
    job_id = (await client.post("/v1/generations", json=_ref_body("op-ok"), headers=AUTH)).json()["id"]
    done, _ = await _wait_for_status(client, job_id, {"succeeded"})
    assert done["charge"] == {"id": "ch_" + job_id.removeprefix("job_"), "amount": "0.040100", "currency": "USD"}
    assert "refund" not in done
    await client.post("/_sim/config", json={"fault_job_failed": 1.0})
    job_id = (await client.post("/v1/generations", json=_ref_body("op-ko"), headers=AUTH)).json()["id"]
    done, _ = await _wait_for_status(client, job_id, {"failed"})
    assert done["refund"] == {"id": "rf_" + job_id.removeprefix("job_"), "amount": "0.040100", "currency": "USD"}
    [job] = (await _operation(client, "op-ko"))["jobs"]
    assert (job["refund_id"], job["charge_amount"]) == (done["refund"]["id"], "0.040100")


def test_prices_must_be_decimals() -> None:
    with pytest.raises(ValueError, match="price_per_context_token must be a decimal"):
        SimulatorConfig(price_per_context_token="cheap")
    with pytest.raises(ValueError, match="finite decimal >= 0"):
        SimulatorConfig(price_per_generated_token="-1")


async def test_per_account_limit_answers_429_with_retry_after_and_counts_them(start_sim: Factory) -> None:
    client = await start_sim(rate_limit_post_per_s=2.0, rate_limit_get_per_s=1.0, rate_limit_burst=2)
    posts = [await client.post("/v1/generations", json=_body(f"op-l{i}"), headers=AUTH) for i in range(3)]
    assert [r.status_code for r in posts] == [201, 201, 429]
    assert posts[2].headers["Retry-After"] == "1" and posts[2].json()["error"]["code"] == "rate_limited"
    other = {"Authorization": "Bearer other-account"}
    assert (await client.post("/v1/generations", json=_body("op-o"), headers=other)).status_code == 201
    job_id = posts[0].json()["id"]
    gets = [(await client.get(f"/v1/generations/{job_id}", headers=AUTH)).status_code for _ in range(3)]
    assert gets == [200, 200, 429]
    s = await _summary(client)
    assert s["rate_limit_429s"] == {"POST": 1, "GET": 1}
    assert (s["posts"], s["jobs_created"], s["gets"]) == (4, 3, 3)
    assert (await _operation(client, "op-l2"))["post_statuses"] == [429]
    await client.post("/_sim/reset")
    assert (await _summary(client))["rate_limit_429s"] == {"POST": 0, "GET": 0}


async def test_per_account_limit_is_off_by_default(start_sim: Factory) -> None:
    client = await start_sim()
    codes = [
        (await client.post("/v1/generations", json=_body(f"op-n{i}"), headers=AUTH)).status_code for i in range(20)
    ]
    assert codes == [201] * 20
    assert (await _summary(client))["rate_limit_429s"] == {"POST": 0, "GET": 0}


def test_a_dated_retry_after_is_whole_seconds_from_its_own_date() -> None:
    headers = dated_retry_after(1_700_000_000.4, 2.3)  # 2.3 s from .4: 2.7 s after the second, rounded up to 3
    assert headers == {"Date": "Tue, 14 Nov 2023 22:13:20 GMT", "Retry-After": "Tue, 14 Nov 2023 22:13:23 GMT"}
    assert dated_retry_after(1_700_000_000.0, 0.01)["Retry-After"] == "Tue, 14 Nov 2023 22:13:21 GMT"  # >= 1 s


async def test_retry_after_dates_on_429s_and_get_answers_read_against_their_date(start_sim: Factory) -> None:
    client = await start_sim(rate_limit_post_per_s=0.5, rate_limit_burst=1, retry_after_dates=True, compression=0.1)
    created, limited = [await client.post("/v1/generations", json=_body(f"op-d{i}"), headers=AUTH) for i in range(2)]
    assert (created.status_code, limited.status_code) == (201, 429)
    # A worker reads the date against the answer's Date, whatever its own clock says (here 1 to 2 s of a 0.5/s
    # limit's 2 s wait, rounded to whole seconds).
    wait_s = parse_retry_after_s(limited.headers["Retry-After"], date=limited.headers["Date"])
    assert wait_s is not None and 1.0 <= wait_s <= 3.0
    answer = await client.get(f"/v1/generations/{created.json()['id']}", headers=AUTH)
    hint_s = parse_retry_after_s(answer.headers["Retry-After"], date=answer.headers["Date"])
    # Date is the answer's time cut to the second and Retry-After that plus the hint rounded up to a second, so
    # the date-to-date span exceeds the hint by the cut fraction and the rounding: less than 2 s in all.
    poll_after_s = answer.json()["poll_after_ms"] / 1000
    assert hint_s is not None and poll_after_s <= hint_s < poll_after_s + 2


async def test_a_job_canceled_at_the_provider_ends_canceled_without_outputs(start_sim: Factory) -> None:
    client = await start_sim(compression=1.0)  # real time: the job is still queued or running when canceled
    job_id = (await client.post("/v1/generations", json=_ref_body("op-x"), headers=AUTH)).json()["id"]
    r = await client.post(f"/v1/generations/{job_id}/cancel", headers=AUTH)
    assert (r.status_code, r.json()) == (200, {"id": job_id, "status": "canceled"})
    got = (await client.get(f"/v1/generations/{job_id}", headers=AUTH)).json()
    assert got["status"] == "canceled" and "outputs" not in got and "charge" not in got
    assert got["completed_at"] is not None
    r = await client.post(f"/v1/generations/{job_id}/cancel", headers=AUTH)  # a second cancel: already ended
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "already_terminal" and r.json()["error"]["job_status"] == "canceled"
    [job] = (await _operation(client, "op-x"))["jobs"]
    assert job["cancels"] == 2 and job["status"] == "canceled"
    assert (await _summary(client))["jobs_by_status"]["canceled"] == 1


async def test_a_cancel_of_a_finished_job_answers_that_it_is_terminal(start_sim: Factory) -> None:
    client = await start_sim(compression=100.0)
    job_id = (await client.post("/v1/generations", json=_ref_body("op-done"), headers=AUTH)).json()["id"]
    await _wait_for_status(client, job_id, {"succeeded"})
    r = await client.post(f"/v1/generations/{job_id}/cancel", headers=AUTH)
    assert r.status_code == 409 and r.json()["error"]["job_status"] == "succeeded"
    got = (await client.get(f"/v1/generations/{job_id}", headers=AUTH)).json()
    assert got["status"] == "succeeded" and got["outputs"]  # the cancel changed nothing
    assert (await client.post("/v1/generations/job_0000000000000000/cancel", headers=AUTH)).status_code == 404
