"""The remote API client's error taxonomy, driven through an injected ``httpx.MockTransport``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest

from streams.config import Settings
from streams.errors import (
    RemoteContractError,
    RemoteError,
    RemoteJobNotFoundError,
    RemoteNotSentError,
    RemoteRateLimitedError,
    RemoteRefusedError,
    RemoteTransientError,
    RemoteUnknownOutcomeError,
    RemoteUnknownStatusError,
)
from streams.model.answers import JobSnapshot
from streams.model.states import OperationState
from streams.remote.client import RemoteClient, SubmitResult, parse_retry_after_s

OP = "operation-42"
REQUEST = '{"input": {"prompt": "Write a haiku about leases", "max_tokens": 44}}'

Handler = Callable[[httpx.Request], httpx.Response]


class Recorder:
    """A MockTransport handler that records requests and answers with a fixed response (or raises)."""

    def __init__(self, respond: Handler) -> None:
        self.respond = respond
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.respond(request)


def answer(status: int, body: Any = None, headers: dict[str, str] | None = None) -> Handler:
    def respond(request: httpx.Request) -> httpx.Response:
        content = b"" if body is None else (body if isinstance(body, bytes) else orjson.dumps(body))
        return httpx.Response(status, content=content, headers=headers)

    return respond


def raising(exc_type: type[httpx.TransportError]) -> Handler:
    def respond(request: httpx.Request) -> httpx.Response:
        raise exc_type("simulated", request=request)

    return respond


@pytest.fixture
def settings() -> Settings:
    return Settings()


ClientFactory = Callable[[Handler], tuple[RemoteClient, Recorder]]


@pytest.fixture
async def make_client(settings: Settings) -> AsyncIterator[ClientFactory]:
    clients: list[RemoteClient] = []

    def factory(respond: Handler) -> tuple[RemoteClient, Recorder]:
        recorder = Recorder(respond)
        client = RemoteClient.from_settings(settings, transport=httpx.MockTransport(recorder))
        clients.append(client)
        return client, recorder

    yield factory
    for c in clients:
        await c.aclose()


# --- submit: created -------------------------------------------------------------------------------------------


async def test_submit_201_with_id(make_client: ClientFactory) -> None:
    client, rec = make_client(answer(201, {"id": "job-1", "status": "queued", "poll_after_ms": 250}))
    started = time.perf_counter()
    result = await client.submit(OP, REQUEST)
    around_ms = (time.perf_counter() - started) * 1000.0
    assert isinstance(result, SubmitResult)
    assert (result.job_id, result.status_code, result.via_error, result.poll_after_s) == ("job-1", 201, False, 0.25)
    assert 0.0 < result.duration_ms <= around_ms  # milliseconds of this call, measured inside it
    assert len(rec.requests) == 1


async def test_submit_sends_body_auth_and_path(make_client: ClientFactory, settings: Settings) -> None:
    client, rec = make_client(answer(201, {"id": "job-1"}))
    await client.submit(OP, REQUEST)
    (request,) = rec.requests
    assert request.method == "POST"
    assert str(request.url) == "http://127.0.0.1:8900/v1/generations"
    assert request.headers["Authorization"] == "Bearer dev-key"
    assert request.headers["Content-Type"] == "application/json"
    assert request.content == (
        b'{"input": {"prompt": "Write a haiku about leases", "max_tokens": 44},'
        b'"model":"sim-1","metadata":{"client_reference":"operation-42"}}'
    )


async def test_submit_request_model_overrides_default(make_client: ClientFactory) -> None:
    client, rec = make_client(answer(200, {"id": "job-9"}))
    result = await client.submit(OP, '{"model": "other-model", "input": {}}')
    assert result.status_code == 200
    sent = rec.requests[0].content
    assert sent == b'{"model": "other-model", "input": {},"metadata":{"client_reference":"operation-42"}}'


async def test_submit_201_without_hint(make_client: ClientFactory) -> None:
    client, _ = make_client(answer(201, {"id": "job-1"}))
    result = await client.submit(OP, REQUEST)
    assert result.poll_after_s is None


async def test_submit_retry_after_header_beats_poll_after_ms(make_client: ClientFactory) -> None:
    client, _ = make_client(answer(202, {"id": "job-1", "poll_after_ms": 250}, {"Retry-After": "2"}))
    result = await client.submit(OP, REQUEST)
    assert result.poll_after_s == 2.0


async def test_submit_502_with_job_id_is_created(make_client: ClientFactory) -> None:
    body = {"error": {"code": "bad_gateway", "message": "upstream hiccup", "job_id": "job-502"}, "poll_after_ms": 1500}
    client, _ = make_client(answer(502, body))
    result = await client.submit(OP, REQUEST)
    assert result == SubmitResult("job-502", 502, True, 1.5, result.duration_ms)


# --- submit: unknown outcome -----------------------------------------------------------------------------------


def assert_carries(exc: RemoteError, status_code: int | None) -> None:
    assert exc.operation_id == OP
    assert exc.status_code == status_code
    assert str(exc).startswith(f"operation {OP}: ")


@pytest.mark.parametrize(
    "body",
    [
        {"error": {"code": "bad_gateway", "message": "no job"}},
        {"error": {"code": "bad_gateway", "job_id": ""}},
        {"error": {"code": "bad_gateway", "job_id": 17}},
        {"error": "bad gateway"},
        b"<html>bad gateway</html>",
        None,
    ],
)
async def test_submit_502_without_job_id_is_unknown(make_client: ClientFactory, body: Any) -> None:
    client, _ = make_client(answer(502, body))
    with pytest.raises(RemoteUnknownOutcomeError) as info:
        await client.submit(OP, REQUEST)
    assert_carries(info.value, 502)


@pytest.mark.parametrize("status", [500, 503, 504])
async def test_submit_5xx_is_unknown(make_client: ClientFactory, status: int) -> None:
    # Even a job id in a non-502 error is not trusted as "created".
    client, _ = make_client(answer(status, {"error": {"code": "internal", "job_id": "job-x"}}))
    with pytest.raises(RemoteUnknownOutcomeError) as info:
        await client.submit(OP, REQUEST)
    assert_carries(info.value, status)


@pytest.mark.parametrize(
    "body", [{"status": "queued"}, {"id": ""}, {"id": 123}, {"id": None}, [1, 2], b"not json", None]
)
async def test_submit_2xx_without_id_is_unknown(make_client: ClientFactory, body: Any) -> None:
    client, _ = make_client(answer(201, body))
    with pytest.raises(RemoteUnknownOutcomeError) as info:
        await client.submit(OP, REQUEST)
    assert_carries(info.value, 201)


@pytest.mark.parametrize(
    "exc_type", [httpx.ReadTimeout, httpx.WriteTimeout, httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError]
)
async def test_submit_failure_after_send_is_unknown(
    make_client: ClientFactory, exc_type: type[httpx.TransportError]
) -> None:
    client, _ = make_client(raising(exc_type))
    with pytest.raises(RemoteUnknownOutcomeError) as info:
        await client.submit(OP, REQUEST)
    assert_carries(info.value, None)
    assert isinstance(info.value.__cause__, exc_type)
    assert not isinstance(info.value, RemoteNotSentError)


# --- submit: not sent ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exc_type", [httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout])
async def test_submit_not_sent(make_client: ClientFactory, exc_type: type[httpx.TransportError]) -> None:
    client, _ = make_client(raising(exc_type))
    with pytest.raises(RemoteNotSentError) as info:
        await client.submit(OP, REQUEST)
    assert_carries(info.value, None)
    assert isinstance(info.value.__cause__, exc_type)


# --- submit: refused -------------------------------------------------------------------------------------------


async def test_submit_429_rate_limited(make_client: ClientFactory) -> None:
    client, _ = make_client(answer(429, {"error": {"code": "rate_limited"}}, {"Retry-After": "3"}))
    with pytest.raises(RemoteRateLimitedError) as info:
        await client.submit(OP, REQUEST)
    exc = info.value
    assert isinstance(exc, RemoteRefusedError)
    assert exc.retry_after_s == 3.0
    assert exc.code == "rate_limited"
    assert_carries(exc, 429)


async def test_submit_429_without_retry_after_defaults_to_one_second(make_client: ClientFactory) -> None:
    client, _ = make_client(answer(429, None))
    with pytest.raises(RemoteRateLimitedError) as info:
        await client.submit(OP, REQUEST)
    assert info.value.retry_after_s == 1.0


@pytest.mark.parametrize(
    ("status", "code"), [(400, "invalid_request"), (422, "unprocessable"), (401, "unauthorized"), (409, "conflict")]
)
async def test_submit_4xx_refused_with_code(make_client: ClientFactory, status: int, code: str) -> None:
    client, _ = make_client(answer(status, {"error": {"code": code, "message": "generated_tokens must be >= 1"}}))
    with pytest.raises(RemoteRefusedError) as info:
        await client.submit(OP, REQUEST)
    exc = info.value
    assert type(exc) is RemoteRefusedError
    assert exc.code == code
    assert_carries(exc, status)
    assert f"HTTP {status} {code}: generated_tokens must be >= 1" in str(exc)


async def test_submit_4xx_without_body_code(make_client: ClientFactory) -> None:
    client, _ = make_client(answer(400, b"nope"))
    with pytest.raises(RemoteRefusedError) as info:
        await client.submit(OP, REQUEST)
    assert info.value.code == "http_400"
    assert "Bad Request" in str(info.value)


# --- observe ---------------------------------------------------------------------------------------------------


async def test_observe_running(make_client: ClientFactory) -> None:
    client, rec = make_client(answer(200, {"id": "job-1", "status": "running", "poll_after_ms": 400}))
    snap = await client.observe(OP, "job-1")
    assert isinstance(snap, JobSnapshot)
    assert (snap.job_id, snap.status, snap.state, snap.poll_after_s) == (
        "job-1",
        "running",
        OperationState.RUNNING,
        0.4,
    )
    assert snap.outputs == []
    assert snap.completed_at_ms is None
    assert snap.error is None
    assert snap.status_code == 200
    (request,) = rec.requests
    assert request.method == "GET"
    assert str(request.url) == "http://127.0.0.1:8900/v1/generations/job-1"
    assert request.headers["Authorization"] == "Bearer dev-key"


async def test_observe_an_answer_for_another_job_is_not_read(make_client: ClientFactory) -> None:
    # A 200 naming another job is some other request's answer (a mixed-up connection): its status and outputs
    # must never become this job's; the GET is retried. An answer without an id is read as before.
    outputs = [{"id": "out-0", "text": "someone else's"}]
    client, _ = make_client(answer(200, {"id": "job-2", "status": "succeeded", "outputs": outputs}))
    with pytest.raises(RemoteTransientError, match="for another job"):
        await client.observe(OP, "job-1")
    client, _ = make_client(answer(200, {"status": "running"}))
    assert (await client.observe(OP, "job-1")).state is OperationState.RUNNING


async def test_observe_succeeded_with_outputs(make_client: ClientFactory) -> None:
    outputs = [{"id": "out-0", "text": "a"}, {"id": "out-1", "text": "b"}]
    body = {"id": "job-1", "status": "succeeded", "outputs": outputs, "completed_at": 1700000000.123}
    client, _ = make_client(answer(200, body))
    snap = await client.observe(OP, "job-1")
    assert snap.state is OperationState.SUCCEEDED
    assert snap.outputs == outputs
    assert snap.completed_at_ms == 1700000000123
    assert isinstance(snap.completed_at_ms, int)
    assert snap.poll_after_s is None
    assert snap.as_observation() == {
        "job_id": "job-1",
        "status": "succeeded",
        "outputs": 2,
        "completed_at_ms": 1700000000123,
        "error": None,
        "charge": None,
        "refund": None,
    }


async def test_observe_completed_at_already_in_ms(make_client: ClientFactory) -> None:
    body = {"status": "failed", "completed_at": 1700000000123, "error": {"code": "oom"}}
    client, _ = make_client(answer(200, body))
    snap = await client.observe(OP, "job-1")
    assert snap.state is OperationState.FAILED
    assert snap.completed_at_ms == 1700000000123
    assert snap.error == {"code": "oom"}


async def test_observe_404(make_client: ClientFactory) -> None:
    client, _ = make_client(answer(404, {"error": {"code": "not_found"}}))
    with pytest.raises(RemoteJobNotFoundError) as info:
        await client.observe(OP, "job-1")
    assert_carries(info.value, 404)


async def test_observe_429(make_client: ClientFactory) -> None:
    client, _ = make_client(answer(429, None, {"Retry-After": "7"}))
    with pytest.raises(RemoteRateLimitedError) as info:
        await client.observe(OP, "job-1")
    assert info.value.retry_after_s == 7.0
    assert_carries(info.value, 429)


@pytest.mark.parametrize("status", [500, 502, 503, 201, 400])
async def test_observe_non_200_is_transient(make_client: ClientFactory, status: int) -> None:
    client, _ = make_client(answer(status, {"status": "running"}))
    with pytest.raises(RemoteTransientError) as info:
        await client.observe(OP, "job-1")
    assert_carries(info.value, status)


@pytest.mark.parametrize("body", [b"not json", [1, 2]])
async def test_observe_unreadable_200_is_transient(make_client: ClientFactory, body: Any) -> None:
    client, _ = make_client(answer(200, body))
    with pytest.raises(RemoteTransientError) as info:
        await client.observe(OP, "job-1")
    assert_carries(info.value, 200)


@pytest.mark.parametrize(
    "body",
    [{"status": "exploded"}, {"status": "aborted"}, {"status": "paused"}, {"status": None}, {"status": 3}, {}],
)
async def test_observe_unknown_status_keeps_the_raw_answer(make_client: ClientFactory, body: Any) -> None:
    client, _ = make_client(answer(200, body))
    with pytest.raises(RemoteUnknownStatusError) as info:
        await client.observe(OP, "job-1")
    assert_carries(info.value, 200)
    assert info.value.answer == {"http_status": 200, "body": orjson.dumps(body).decode()}


async def test_observe_404_keeps_the_raw_answer(make_client: ClientFactory) -> None:
    client, _ = make_client(answer(404, {"error": {"code": "not_found", "message": "no such generation"}}))
    with pytest.raises(RemoteJobNotFoundError) as info:
        await client.observe(OP, "job-1")
    assert info.value.answer["http_status"] == 404
    assert orjson.loads(str(info.value.answer["body"]))["error"]["code"] == "not_found"


async def test_observe_carries_charge_and_refund_as_sent(make_client: ClientFactory) -> None:
    charge = {"id": "ch_1", "amount": "0.001250", "currency": "USD"}
    refund = {"id": "rf_1", "amount": "0.001250", "currency": "USD"}
    client, _ = make_client(answer(200, {"status": "failed", "charge": charge, "refund": refund}))
    snapshot = await client.observe(OP, "job-1")
    assert (snapshot.charge, snapshot.refund) == (charge, refund)
    assert snapshot.as_observation()["charge"] == charge and snapshot.as_observation()["refund"] == refund
    client, _ = make_client(answer(200, {"status": "running", "charge": "12", "refund": None}))
    snapshot = await client.observe(OP, "job-1")
    assert (snapshot.charge, snapshot.refund) == (None, None)


@pytest.mark.parametrize(
    "outputs",
    [
        "nope",
        [{"text": "no id"}],
        [{"id": None}],
        [{"id": 7}],
        [{"id": "o1", "text": "first"}, {"id": "o1", "text": "second"}],
    ],
)
async def test_observe_outputs_without_distinct_string_ids_break_the_contract(
    make_client: ClientFactory, outputs: Any
) -> None:
    client, _ = make_client(answer(200, {"status": "succeeded", "outputs": outputs}))
    with pytest.raises(RemoteContractError) as info:
        await client.observe(OP, "job-1")
    assert_carries(info.value, 200)


async def test_job_ids_are_escaped_in_the_url_and_refused_when_unusable(make_client: ClientFactory) -> None:
    client, seen = make_client(answer(200, {"status": "running"}))
    await client.observe(OP, "a/../b?x=1#")
    assert seen.requests[0].url.raw_path == b"/v1/generations/a%2F..%2Fb%3Fx%3D1%23"
    for dots, path in ((".", b"/v1/generations/%2E"), ("..", b"/v1/generations/%2E%2E")):
        await client.observe(OP, dots)  # never a step up to another resource
        assert seen.requests[-1].url.raw_path == path
    for bad in ("a/../b", "x\r\n", "j" * 300, ""):
        client2, _ = make_client(answer(201, {"id": bad}))
        with pytest.raises(RemoteUnknownOutcomeError, match="without a usable job id"):
            await client2.submit(OP, REQUEST)


async def test_hints_are_capped_and_absurd_times_ignored(make_client: ClientFactory) -> None:
    client, _ = make_client(answer(201, {"id": "J1", "poll_after_ms": 1e16}))
    result = await client.submit(OP, REQUEST)
    assert result.poll_after_s == 3600.0
    # an integer past a float's range: OverflowError out of submit, after the POST, its job id lost
    client, _ = make_client(answer(201, b'{"id": "J2", "poll_after_ms": ' + b"9" * 400 + b"}"))
    result = await client.submit(OP, REQUEST)
    assert (result.job_id, result.poll_after_s) == ("J2", 3600.0)
    client, _ = make_client(answer(200, {"status": "succeeded", "outputs": [], "completed_at": 1e20}))
    snapshot = await client.observe(OP, "job-1")
    assert snapshot.completed_at_ms is None


@pytest.mark.parametrize("exc_type", [httpx.ConnectError, httpx.ReadTimeout, httpx.RemoteProtocolError])
async def test_observe_transport_error_is_transient(
    make_client: ClientFactory, exc_type: type[httpx.TransportError]
) -> None:
    client, _ = make_client(raising(exc_type))
    with pytest.raises(RemoteTransientError) as info:
        await client.observe(OP, "job-1")
    assert_carries(info.value, None)
    assert isinstance(info.value.__cause__, exc_type)


# --- parse_retry_after_s ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("3", 3.0),
        (" 2.5 ", 2.5),
        ("0", 0.0),
        ("-4", None),
        ("", None),
        ("soon", None),
        ("inf", None),
        ("nan", None),
        ("1e9", None),
        ("99999", 3600.0),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),
    ],
)
def test_parse_retry_after_s(value: str | None, expected: float | None) -> None:
    assert parse_retry_after_s(value) == expected
