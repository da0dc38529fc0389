"""The edges of docs/limits.md on the real services: one depth limit through every edge and reader, and no
payload in any log line."""

from __future__ import annotations

import io
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import orjson
import pytest
from prometheus_client import REGISTRY

from streams import logs
from streams.oncall import liveview, operations
from streams.wire import exactjson
from streams.wire.exactjson import MAX_DEPTH
from streams.worker.app import handle_with_retries
from streams.worker.runtime import RawMessage, Runtime
from streams.worker.stages.dispatcher import Dispatcher, request_digest

pytestmark = pytest.mark.integration


@pytest.fixture
def every_log_line() -> Iterator[io.StringIO]:
    """Everything every logger writes while the test runs, at every level."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    root = logging.getLogger()
    saved = root.level
    root.setLevel(logging.DEBUG)
    root.addHandler(handler)
    yield stream
    root.removeHandler(handler)
    root.setLevel(saved)


def _submission(op: str, request_text: bytes, offset: int) -> RawMessage:
    value = b'{"operation_id":"' + op.encode() + b'","submitted_at_ms":1,"request":' + request_text + b"}"
    return RawMessage("generation.submissions", 0, offset, op.encode(), value)


def _nested_request(levels: int) -> bytes:
    """A request that makes the submission ``levels`` deep in all (envelope 1, request 2, ``x`` 3...)."""
    inner = max(levels - 2, 0)
    return b'{"input":{"prompt":"hi","max_tokens":5},"x":' + b"[" * inner + b"]" * inner + b"}"


def _dead_letters(reason: str) -> float:
    labels = {"topic": "generation.submissions", "reason": reason}
    return REGISTRY.get_sample_value("streams_dead_letters_total", labels) or 0.0


@pytest.mark.parametrize("levels", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 100_000])
async def test_one_depth_limit_through_every_edge_and_reader(runtime: Runtime, pool: asyncpg.Pool, levels: int) -> None:
    op = f"deep-{levels}-{uuid.uuid4().hex[:8]}"
    dispatcher = Dispatcher(runtime)
    message = _submission(op, _nested_request(levels), 1)
    before = _dead_letters("too_deep"), _dead_letters("processing_error")
    await handle_with_retries(runtime, dispatcher.handle, message)
    if levels > MAX_DEPTH:
        assert (_dead_letters("too_deep") - before[0], _dead_letters("processing_error") - before[1]) == (1, 0)
        assert await pool.fetchval("SELECT count(*) FROM operations WHERE operation_id = $1", op) == 0
        return
    detail = await operations.operation_detail(pool, None, runtime.settings, op)
    assert detail is not None
    assert exactjson.depth(detail["operation"]["request"]) == levels - 1
    assert op in operations.format_detail(detail)  # `streams operations show`
    assert op in operations.to_json(detail)  # `streams operations show --json`, the live view's ?format=json
    assert op in liveview.render_operation(detail)  # the live view's page
    assert len(request_digest(detail["operation"]["request"])) == 16
    await handle_with_retries(runtime, dispatcher.handle, _submission(op, _nested_request(levels), 2))  # a replay
    assert (_dead_letters("too_deep"), _dead_letters("processing_error")) == before  # accepted once, no letter


MARK = "PROMPT-MARK-" + uuid.uuid4().hex


async def test_no_log_line_of_any_level_carries_a_prompt(
    runtime: Runtime, pool: asyncpg.Pool, every_log_line: io.StringIO
) -> None:
    dispatcher = Dispatcher(runtime)
    tag = uuid.uuid4().hex[:8]
    prompt = (MARK + " ") * 2_200  # ~100 KB of prompt
    good = {"input": {"prompt": prompt, "max_tokens": 5}}
    cases: list[tuple[str, Any]] = [
        (f"marked-ok-{tag}", good),  # accepted and POSTed
        (f"marked-ok-{tag}", {"input": {"prompt": MARK + " other", "max_tokens": 5}}),  # conflicting duplicate
        (f"marked-schema-{tag}", {"input": {"prompt": "x"}, "metadata": prompt}),  # refused by the schema
        (f"marked-model-{tag}", {"model": {"prompt": prompt}}),  # refused by the schema, an object
    ]
    for offset, (op, request) in enumerate(cases, 1):
        await handle_with_retries(runtime, dispatcher.handle, _submission(op, orjson.dumps(request), offset))
    text = every_log_line.getvalue()
    assert "dead-lettered" in text and "schema" in text and "conflicting_duplicate" in text
    assert MARK not in text
    ours = [line for line in text.splitlines() if orjson.loads(line)["logger"].startswith("streams")]
    assert max(map(len, ours)) < 2_000  # aiokafka's DEBUG lines carry records (base64 here): docs/limits.md
