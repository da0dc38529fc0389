"""Provider dialects: the declarations load and refuse what is wrong, and answers of each dialect map to the model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp.test_utils import TestServer

from streams.config import Settings
from streams.errors import (
    ConfigError,
    RemoteContractError,
    RemoteRefusedError,
    RemoteUnknownOutcomeError,
    RemoteUnknownStatusError,
)
from streams.model.codes import RemoteCallOutcome
from streams.model.states import REMOTE_STATUS_TO_STATE, OperationState
from streams.remote.client import RemoteClient, make_http_client
from streams.remote.dialect import DIALECTS_PACKAGE, load_dialect, shipped_dialects
from streams_harness.simulator import SimulatorConfig, make_app

OP = "op-dialect"
REQUEST = '{"input": {"prompt": "three words here", "max_tokens": 2}}'
SEED = load_dialect("seed-generations")
REPLICATE = load_dialect("replicate-predictions")


def shipped_text(name: str) -> dict[str, Any]:
    from importlib import resources

    data: dict[str, Any] = json.loads(resources.files(DIALECTS_PACKAGE).joinpath(f"{name}.json").read_text())
    return data


def test_both_declarations_ship_and_the_seed_is_the_default() -> None:
    assert shipped_dialects() == ["replicate-predictions", "seed-generations"]
    assert Settings().provider_dialect == "seed-generations"
    assert (SEED.create_method, SEED.create_path, SEED.get_path) == (
        "POST",
        "/v1/generations",
        "/v1/generations/{job_id}",
    )
    assert SEED.cancel_path == Settings().remote_cancel_path
    assert (SEED.auth_header, SEED.auth_scheme) == (Settings().remote_auth_header, Settings().remote_auth_scheme)
    assert SEED.statuses == REMOTE_STATUS_TO_STATE  # the seed's words, as the model knew them
    assert SEED.answer.job_id == ("id",) and SEED.answer.error_job_id == ("error", "job_id")
    assert REPLICATE.create_headers == (("Prefer", "wait=5"),)
    assert REPLICATE.get_path == "/v1/predictions/{job_id}" and REPLICATE.answer.outputs == ("output",)
    assert REPLICATE.answer.poll_after_ms == () and REPLICATE.answer.charge == ()
    assert REPLICATE.lookup is None
    assert SEED.lookup is not None
    assert (SEED.lookup.path, SEED.lookup.reference_param, SEED.lookup.jobs) == (
        "/v1/generations",
        "client_reference",
        ("data",),
    )
    assert {w: s.value for w, s in REPLICATE.statuses.items()} == {
        "starting": "queued",
        "processing": "running",
        "succeeded": "succeeded",
        "failed": "failed",
        "canceled": "canceled",
    }


def test_an_unknown_dialect_is_refused_when_the_client_is_built() -> None:
    with pytest.raises(ConfigError, match=r"'nope': no such declaration.*replicate-predictions"):
        RemoteClient.from_settings(Settings(provider_dialect="nope"))
    with pytest.raises(ConfigError, match=r"cannot read the declaration /no/such/file\.json"):
        load_dialect("/no/such/file.json")


def write(tmp_path: Path, data: Any) -> str:
    path = tmp_path / "dialect.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d.update(extra=1), "unknown key(s) ['extra'] in the declaration"),
        (lambda d: d["answer"].update(job_idd="id"), "unknown key(s) ['job_idd'] in answer"),
        (lambda d: d.pop("statuses"), "missing key(s) ['statuses']"),
        (lambda d: d["answer"].pop("error"), "missing key(s) ['error'] in answer"),
        (lambda d: d["statuses"].update(paused="sleeping"), "statuses.paused is 'sleeping'"),
        (lambda d: d["get"].update(path="/v1/x"), "get.path is '/v1/x': expected an absolute path with {job_id}"),
        (lambda d: d["answer"].update(status=""), "answer.status must name where it sits"),
        (lambda d: d["answer"].update(outputs="a..b"), "answer.outputs is 'a..b'"),
        (lambda d: d["answer"].update(outputs_shape="rows"), "answer.outputs_shape is 'rows'"),
        # declared fields the product would not act on are unknown keys, refused
        (lambda d: d["request"].update(input_field="input"), "unknown key(s) ['input_field'] in request"),
        (lambda d: d["answer"].update(get_url="urls.get"), "unknown key(s) ['get_url'] in answer"),
        (lambda d: d["answer"].update(cancel_url="urls.cancel"), "unknown key(s) ['cancel_url'] in answer"),
        (lambda d: d.update(callback_signature="none"), "unknown key(s) ['callback_signature'] in the declaration"),
        (lambda d: d.pop("lookup"), "missing key(s) ['lookup']"),
        (lambda d: d.update(lookup={"path": "/v1/x"}), "missing key(s) ['jobs', 'reference_param'] in lookup"),
        (lambda d: d.update(lookup={"path": "/v1/{job_id}", "reference_param": "r", "jobs": "data"}), "lookup.path"),
        (lambda d: d.update(lookup={"path": "/v1/x?a=1", "reference_param": "r", "jobs": "data"}), "the query is"),
        (lambda d: d.update(lookup={"path": "/v1/x", "reference_param": "r", "jobs": ""}), "lookup.jobs must name"),
        (lambda d: d.update(lookup="/v1/x"), "lookup must be a JSON object"),
        (lambda d: d["create"].update(method="FETCH"), "create.method is 'FETCH'"),
        # hostile or wrong route templates: httpx resolves dot segments, so '/../..' left the base URL's path
        (lambda d: d["get"].update(path="/../../admin/{job_id}"), "get.path is '/../../admin/{job_id}': a '.'"),
        (lambda d: d["get"].update(path="/v1/%2E%2e/{job_id}"), "get.path is '/v1/%2E%2e/{job_id}': a '.'"),
        (lambda d: d["cancel"].update(path="/v1/./{job_id}"), "cancel.path is '/v1/./{job_id}': a '.'"),
        (lambda d: d["get"].update(path="//evil.example/{job_id}"), "an empty segment"),
        (lambda d: d["get"].update(path="/v1/{model}/{job_id}"), "the only placeholder a route may hold"),
        (lambda d: d["get"].update(path="/v1/{job_id}/{job_id}"), "expected an absolute path with {job_id} once"),
        (lambda d: d["get"].update(path="/v1/x?id={job_id}"), "{job_id} must be in the path"),
        (lambda d: d["cancel"].update(path="/v1/{job_id}#c"), "no fragment"),
        (lambda d: d["create"].update(path="/v1/predictions now"), "no fragment ('#'), space"),
        # two spellings of one word: the second silently replaced the first's state
        (lambda d: d["statuses"].update({"Succeeded ": "failed"}), "the word 'succeeded' again"),
        (lambda d: d["statuses"].update({" ": "failed"}), "an empty status word"),
    ],
)
def test_a_wrong_declaration_is_refused_naming_the_key(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], words: str
) -> None:
    data = shipped_text("replicate-predictions")
    change(data)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as caught:
        load_dialect(path)
    assert words in str(caught.value) and path in str(caught.value)


def test_a_declaration_file_by_path_loads(tmp_path: Path) -> None:
    data = shipped_text("replicate-predictions")
    data["name"] = "my-provider"
    data["get"]["path"] = "/api/jobs/{job_id}/state"
    dialect = load_dialect(write(tmp_path, data))
    assert dialect.name == "my-provider" and dialect.get_path == "/api/jobs/{job_id}/state"


def test_lookup_on_with_a_dialect_without_lookup_is_refused_when_the_client_is_built() -> None:
    with pytest.raises(
        ConfigError, match=r"STREAMS_LOOKUP_ENABLED is on .* replicate-predictions .*declares no lookup"
    ):
        RemoteClient.from_settings(Settings(provider_dialect="replicate-predictions", lookup_enabled=True))
    RemoteClient.from_settings(Settings(provider_dialect="replicate-predictions"))  # off: builds
    RemoteClient.from_settings(Settings(provider_dialect="seed-generations", lookup_enabled=True))


async def test_a_declared_lookup_is_called_and_read_where_the_declaration_says(tmp_path: Path) -> None:
    data = shipped_text("replicate-predictions")
    data["lookup"] = {"path": "/v1/predictions", "reference_param": "ref", "jobs": "results"}
    seen: Seen = []
    listing = {
        "results": [
            {"id": "p2", "status": "processing", "created_at": "2023-11-14T22:13:21Z"},
            {"id": "p1", "status": "succeeded", "created_at": "2023-11-14T22:13:20Z"},
        ]
    }

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=orjson.dumps(listing))

    settings = Settings(provider_dialect=write(tmp_path, data), lookup_enabled=True)
    remote = RemoteClient.from_settings(settings, transport=httpx.MockTransport(answer))
    try:
        jobs = await remote.lookup(OP)
    finally:
        await remote.aclose()
    assert (seen[0].method, seen[0].url.path, dict(seen[0].url.params)) == ("GET", "/v1/predictions", {"ref": OP})
    assert [(j.job_id, j.status, j.created_at_ms) for j in jobs] == [
        ("p1", "succeeded", 1_700_000_000_000),
        ("p2", "processing", 1_700_000_001_000),
    ]  # oldest first, by the declared created_at


# --- answers of each dialect -------------------------------------------------------------------------------------

Seen = list[httpx.Request]


@pytest.fixture
async def client() -> AsyncIterator[Callable[..., tuple[RemoteClient, Seen]]]:
    made: list[RemoteClient] = []

    def factory(dialect: str, status: int, body: Any) -> tuple[RemoteClient, Seen]:
        seen: Seen = []
        content = body if isinstance(body, bytes) else orjson.dumps(body)

        def answer(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return httpx.Response(status, content=content)

        settings = Settings(provider_dialect=dialect)
        c = RemoteClient.from_settings(settings, transport=httpx.MockTransport(answer))
        made.append(c)
        return c, seen

    yield factory
    for c in made:
        await c.aclose()


PREDICTION = {
    "id": "p1",
    "status": "succeeded",
    "output": ["first", {"n": 2}],
    "error": None,
    "completed_at": "2023-11-14T22:13:20.500Z",
    "urls": {"get": "https://x/v1/predictions/p1", "cancel": "https://x/v1/predictions/p1/cancel"},
}


async def test_a_prediction_maps_to_the_model(client: Callable[..., tuple[RemoteClient, Seen]]) -> None:
    remote, seen = client("replicate-predictions", 200, PREDICTION)
    snapshot = await remote.observe(OP, "p1")
    assert (seen[0].method, seen[0].url.path) == ("GET", "/v1/predictions/p1")
    assert seen[0].headers["Authorization"] == "Bearer dev-key"
    assert (snapshot.status, snapshot.state) == ("succeeded", OperationState.SUCCEEDED)
    assert snapshot.outputs == [{"id": "output_0", "value": "first"}, {"id": "output_1", "value": {"n": 2}}]
    assert snapshot.completed_at_ms == 1_700_000_000_500 and snapshot.error is None
    assert snapshot.poll_after_s is None and snapshot.charge is None


@pytest.mark.parametrize(
    ("word", "state"), [("starting", OperationState.QUEUED), ("Processing", OperationState.RUNNING)]
)
async def test_prediction_status_words(
    client: Callable[..., tuple[RemoteClient, Seen]], word: str, state: OperationState
) -> None:
    remote, _ = client("replicate-predictions", 200, {"id": "p1", "status": word, "output": None})
    snapshot = await remote.observe(OP, "p1")
    assert (snapshot.state, snapshot.outputs) == (state, [])


async def test_a_failed_prediction_carries_its_error_text(client: Callable[..., tuple[RemoteClient, Seen]]) -> None:
    remote, _ = client("replicate-predictions", 200, {"id": "p1", "status": "failed", "error": "CUDA out of memory"})
    snapshot = await remote.observe(OP, "p1")
    assert (snapshot.state, snapshot.error) == (OperationState.FAILED, {"message": "CUDA out of memory"})


@pytest.mark.parametrize(
    ("dialect", "body"),
    [
        ("replicate-predictions", {"id": "p1", "status": "queued"}),  # the seed's word, not this API's
        ("replicate-predictions", {"id": "p1", "state": "succeeded"}),  # status missing
        ("seed-generations", {"id": "p1", "status": "starting"}),  # the prediction API's word, not the seed's
    ],
)
async def test_a_word_the_dialect_does_not_declare_is_an_unknown_status(
    client: Callable[..., tuple[RemoteClient, Seen]], dialect: str, body: dict[str, Any]
) -> None:
    remote, _ = client(dialect, 200, body)
    with pytest.raises(RemoteUnknownStatusError):
        await remote.observe(OP, "p1")


async def test_seed_outputs_without_ids_break_the_contract(client: Callable[..., tuple[RemoteClient, Seen]]) -> None:
    remote, _ = client("seed-generations", 200, {"id": "p1", "status": "succeeded", "outputs": [{"text": "x"}]})
    with pytest.raises(RemoteContractError, match="outputs without distinct string ids"):
        await remote.observe(OP, "p1")


@pytest.mark.parametrize(
    ("outputs", "why"),
    [
        ([{"text": "the private output"}], "1 output(s): an output whose id is missing or not text"),
        ([{"id": "o", "text": "the private output"}] * 2, "2 output(s): an id repeated"),
        (["the private output"], "1 output(s): an output that is not an object"),
        ({"text": "the private output"}, "1 output(s): not a list of objects"),
    ],
)
async def test_outputs_breaking_the_contract_are_described_never_quoted(
    client: Callable[..., tuple[RemoteClient, Seen]], outputs: Any, why: str
) -> None:
    # The message went into the ledger and the logs with the outputs' text (a user payload) in it.
    remote, _ = client("seed-generations", 200, {"id": "p1", "status": "succeeded", "outputs": outputs})
    with pytest.raises(RemoteContractError) as caught:
        await remote.observe(OP, "p1")
    assert "private" not in str(caught.value) and why in str(caught.value)


async def test_a_prediction_create_goes_to_its_route(client: Callable[..., tuple[RemoteClient, Seen]]) -> None:
    remote, seen = client("replicate-predictions", 201, {"id": "p9", "status": "starting"})
    created = await remote.submit(OP, REQUEST)
    assert created.job_id == "p9" and created.poll_after_s is None
    request = seen[0]
    assert (request.method, request.url.path, request.headers["Prefer"]) == ("POST", "/v1/predictions", "wait=5")
    assert orjson.loads(request.content) == {
        "input": {"prompt": "three words here", "max_tokens": 2},
        "model": "sim-1",
        "metadata": {"client_reference": OP},
    }


async def test_a_create_answer_without_the_declared_id_is_an_unknown_outcome(
    client: Callable[..., tuple[RemoteClient, Seen]],
) -> None:
    remote, _ = client("replicate-predictions", 201, {"prediction_id": "p9", "status": "starting"})
    with pytest.raises(RemoteUnknownOutcomeError, match="without a usable job id"):
        await remote.submit(OP, REQUEST)


async def test_a_prediction_refusal_reads_title_and_detail(client: Callable[..., tuple[RemoteClient, Seen]]) -> None:
    remote, _ = client("replicate-predictions", 422, {"title": "invalid_input", "detail": "max_tokens too large"})
    with pytest.raises(RemoteRefusedError) as caught:
        await remote.submit(OP, REQUEST)
    assert caught.value.code == "invalid_input" and "max_tokens too large" in str(caught.value)


async def test_a_prediction_502_has_no_job_id_to_recover(client: Callable[..., tuple[RemoteClient, Seen]]) -> None:
    remote, _ = client("replicate-predictions", 502, {"title": "upstream", "detail": "x", "job_id": "p1"})
    with pytest.raises(RemoteUnknownOutcomeError):
        await remote.submit(OP, REQUEST)


async def test_the_cancel_route_is_the_declarations(client: Callable[..., tuple[RemoteClient, Seen]]) -> None:
    remote, seen = client("replicate-predictions", 200, {"id": "p1", "status": "canceled"})
    result = await remote.cancel(OP, "p1")
    assert result.outcome is RemoteCallOutcome.CANCEL_ACCEPTED
    assert (seen[0].method, seen[0].url.path) == ("POST", "/v1/predictions/p1/cancel")


def test_explicit_auth_and_cancel_settings_override_the_declaration() -> None:
    settings = Settings(
        provider_dialect="replicate-predictions",
        remote_auth_header="X-Api-Key",
        remote_auth_scheme="",
        remote_cancel_path="/v2/p/{job_id}:cancel",
    )
    http = make_http_client(settings, transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    assert http.headers["X-Api-Key"] == "dev-key" and "Authorization" not in http.headers
    remote = RemoteClient.from_settings(settings, transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    assert remote.cancel_path == "/v2/p/{job_id}:cancel"


@pytest.mark.parametrize(
    ("cancel_path", "words"),
    [
        ("/v1/../../admin/{job_id}", "a '.' or '..' segment"),
        ("/v1/{job_id}/{job_id}/cancel", "it must hold {job_id} once"),
        ("/v1/{model}/{job_id}", "the only placeholder"),
    ],
)
def test_an_explicit_cancel_path_is_checked_as_a_declarations_routes(cancel_path: str, words: str) -> None:
    # STREAMS_REMOTE_CANCEL_PATH replaces the declaration's route, and only its pattern (/ ... {job_id}) was checked.
    settings = Settings(remote_cancel_path=cancel_path)
    with pytest.raises(ConfigError, match="STREAMS_REMOTE_CANCEL_PATH") as caught:
        RemoteClient.from_settings(settings, transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    assert words in str(caught.value)


# --- against the simulator, each dialect -------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["seed-generations", "replicate-predictions"])
async def test_a_job_runs_to_its_end_against_the_simulator_in_each_dialect(dialect: str) -> None:
    server = TestServer(
        make_app(SimulatorConfig(dialect=dialect, compression=1000.0, get_latency_ms=0.0, multi_output_rate=1.0)),
        host="127.0.0.1",
        port=0,
    )
    await server.start_server()
    settings = Settings(provider_dialect=dialect, remote_base_url=str(server.make_url("")).rstrip("/"))
    remote = RemoteClient.from_settings(settings)
    try:
        created = await remote.submit(OP, REQUEST)
        snapshot = await remote.observe(OP, created.job_id)
        if dialect == "seed-generations":
            assert snapshot.state is not OperationState.SUCCEEDED or snapshot.outputs[0]["id"] == "out_0"
        else:  # Prefer: wait held the create answer until the job ended (1000x compressed: a few ms)
            assert snapshot.state is OperationState.SUCCEEDED and snapshot.completed_at_ms is not None
            assert [o["id"] for o in snapshot.outputs] == ["output_0", "output_1"]
            assert snapshot.outputs[0]["value"].startswith("simulated output 0 of ")
        cancel = await remote.cancel(OP, created.job_id)
        assert cancel.outcome in (RemoteCallOutcome.CANCEL_ACCEPTED, RemoteCallOutcome.CANCEL_ALREADY_TERMINAL)
    finally:
        await remote.aclose()
        await server.close()


async def test_the_simulator_in_one_dialect_does_not_serve_the_other() -> None:
    server = TestServer(make_app(SimulatorConfig(dialect="replicate-predictions")), host="127.0.0.1", port=0)
    await server.start_server()
    remote = RemoteClient.from_settings(Settings(remote_base_url=str(server.make_url("")).rstrip("/")))
    try:
        with pytest.raises(RemoteRefusedError) as caught:  # the seed's POST /v1/generations: not a route there
            await remote.submit(OP, REQUEST)
        assert caught.value.status_code == 404
    finally:
        await remote.aclose()
        await server.close()


def test_a_prefer_wait_not_shorter_than_the_read_timeout_is_refused() -> None:
    assert REPLICATE.prefer_wait_s() == 5.0 and SEED.prefer_wait_s() is None
    with pytest.raises(ConfigError, match=r"hold each create answer up to 5 s .* STREAMS_HTTP_READ_TIMEOUT_S \(5\)"):
        RemoteClient.from_settings(Settings(provider_dialect="replicate-predictions", http_read_timeout_s=5.0))
    RemoteClient.from_settings(Settings(provider_dialect="seed-generations", http_read_timeout_s=5.0))


async def test_the_simulated_prediction_api_bounds_its_wait_and_answers_errors_as_title_and_detail() -> None:
    config = SimulatorConfig(dialect="replicate-predictions", compression=1.0, prefer_wait_max_s=0.05)
    server = TestServer(make_app(config), host="127.0.0.1", port=0)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    body = {"model": "sim-1", "input": {"prompt": "a b c", "max_tokens": 50}, "metadata": {"client_reference": OP}}
    try:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer k"}, timeout=10) as http:
            held = await http.post("/v1/predictions", json=body, headers={"Prefer": "wait=60"})
            # real time: the job needs seconds; the hold ends at prefer_wait_max_s with the job not done
            assert held.status_code == 201 and held.json()["status"] in ("starting", "processing")
            job_id = held.json()["id"]
            assert held.json()["urls"] == {
                "get": f"{url}/v1/predictions/{job_id}",
                "cancel": f"{url}/v1/predictions/{job_id}/cancel",
            }
            refused = await http.post("/v1/predictions", json={"input": {}})
            assert refused.status_code == 400 and refused.json()["title"] == "invalid_request"
            assert refused.json()["status"] == 400 and "detail" in refused.json()
            assert (await http.post(f"/v1/predictions/{job_id}/cancel")).json()["status"] == "canceled"
            assert (await http.get(f"/v1/predictions/{job_id}")).json()["status"] == "canceled"
    finally:
        await server.close()


@pytest.mark.parametrize(
    ("content", "words"),
    [
        # json.loads raised RecursionError past ~1000 levels: a crash at startup, not a refusal naming the file
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper than"),
        # read_text raised UnicodeDecodeError
        (b"\xff\xfe{}", "not UTF-8"),
        # read whole, however large: a file named by mistake (a log, an image) was read into memory
        (b" " * (2 * 1024 * 1024) + b"{}", "larger than"),
    ],
)
def test_a_declaration_file_that_is_no_declaration_is_refused_naming_it(
    tmp_path: Path, content: bytes, words: str
) -> None:
    path = tmp_path / "broken.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        load_dialect(str(path))
    assert words in str(caught.value) and str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("headers", "words"),
    [
        # accepted, then httpx raised UnicodeEncodeError building the client: a crash, not a refusal
        ({"Prefer": "wait=5 é"}, "create.headers.Prefer"),
        # accepted and sent: a NUL or DEL in a header value
        ({"Prefer": "wait=5\x00"}, "create.headers.Prefer"),
        ({"X-Trace": "a\x7fb"}, "create.headers.X-Trace"),
        # accepted and sent instead of the product's: the body's type and framing, the host, the credentials
        ({"content-type": "text/plain"}, "create.headers.content-type"),
        ({"Content-Length": "0"}, "create.headers.Content-Length"),
        ({"Transfer-Encoding": "chunked"}, "create.headers.Transfer-Encoding"),
        ({"Host": "other.example"}, "create.headers.Host"),
        ({"authorization": "Bearer literal"}, "create.headers.authorization"),
    ],
)
def test_create_headers_the_client_cannot_send_or_must_set_itself_are_refused(
    tmp_path: Path, headers: dict[str, str], words: str
) -> None:
    data = shipped_text("replicate-predictions")
    data["create"]["headers"] = headers
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as caught:
        load_dialect(path)
    assert words in str(caught.value) and path in str(caught.value)


def test_printable_create_headers_load_and_are_sent(tmp_path: Path) -> None:
    data = shipped_text("replicate-predictions")
    data["create"]["headers"] = {"Prefer": "wait=5", "X-Trace": "a b\tc ~!"}
    dialect = load_dialect(write(tmp_path, data))
    assert dialect.create_headers == (("Prefer", "wait=5"), ("X-Trace", "a b\tc ~!"))


@pytest.mark.parametrize(
    "path",
    [
        # sent as written by httpx; servers that read '\\' as '/' or decode '%2F' before resolving dot segments
        # (WHATWG URL parsers, many proxies) then step out of the base URL's path
        "/v1/..\\admin/{job_id}",
        "/v1/%5C..%5Cadmin/{job_id}",
        "/v1/..%2Fadmin/{job_id}",
        "/v1/%2e%2e%2fadmin/{job_id}",
        # a '%' that starts no escape: read differently by each server
        "/v1/%zz/{job_id}",
        "/v1/100%/{job_id}",
    ],
)
def test_a_route_with_a_backslash_an_encoded_slash_or_a_broken_escape_is_refused(tmp_path: Path, path: str) -> None:
    data = shipped_text("replicate-predictions")
    data["get"]["path"] = path
    file = write(tmp_path, data)
    with pytest.raises(ConfigError) as caught:
        load_dialect(file)
    assert f"get.path is {path!r}" in str(caught.value)


@pytest.mark.parametrize("description", [5, ["a"], {"text": "a"}, None])
def test_a_description_that_is_not_text_is_refused(tmp_path: Path, description: Any) -> None:
    # it was silently read as "" (every other value of the wrong kind is refused naming its key)
    data = shipped_text("replicate-predictions")
    data["description"] = description
    file = write(tmp_path, data)
    with pytest.raises(ConfigError) as caught:
        load_dialect(file)
    assert "the declaration.description is" in str(caught.value)


@pytest.mark.parametrize("header", ["Host", "content-type", "Content-Length", "Transfer-Encoding", "Connection"])
def test_an_auth_header_the_client_sets_itself_is_refused(tmp_path: Path, header: str) -> None:
    # accepted: the API key went out as the Host or Content-Type header (or was replaced by the client's own)
    data = shipped_text("replicate-predictions")
    data["auth"]["header"] = header
    file = write(tmp_path, data)
    with pytest.raises(ConfigError) as caught:
        load_dialect(file)
    assert f"auth.header is {header!r}" in str(caught.value)


@pytest.mark.parametrize("header", ["Host", "content-type", "Content-Length"])
def test_an_explicit_auth_header_the_client_sets_itself_is_refused(header: str) -> None:
    # STREAMS_REMOTE_AUTH_HEADER replaces the declaration's header and was only matched against the token pattern
    with pytest.raises(ConfigError, match="STREAMS_REMOTE_AUTH_HEADER") as caught:
        RemoteClient.from_settings(
            Settings(remote_auth_header=header), transport=httpx.MockTransport(lambda r: httpx.Response(200))
        )
    assert repr(header) in str(caught.value)


@pytest.mark.parametrize(
    ("jobs", "why"),
    [
        ({"id": "p1", "input": {"prompt": "private words"}}, "at data: an object, not a list"),
        ([{"id": "p1"}, {"input": {"prompt": "private words"}}], "job 1 of 2 has no usable id"),
        ([{"id": "p1"}, "private words"], "job 1 of 2 is text, not an object"),
    ],
)
async def test_a_lookup_answer_breaking_the_contract_is_described_never_quoted(
    client: Callable[..., tuple[RemoteClient, Seen]], jobs: Any, why: str
) -> None:
    # The message (a reason in the ledger, a log line) quoted 300 characters of the jobs, prompts included.
    remote, _ = client("seed-generations", 200, {"data": jobs})
    with pytest.raises(RemoteContractError) as caught:
        await remote.lookup(OP)
    assert "private" not in str(caught.value) and why in str(caught.value)
