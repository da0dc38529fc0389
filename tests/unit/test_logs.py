"""Log lines: JSON objects and readable lines, with the operation's fields from ``extra=`` or the task's context."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import logging.config
from collections.abc import Iterator

import pytest

from streams import logs

Captured = tuple[logging.Logger, io.StringIO, "logging.StreamHandler[io.StringIO]"]


@pytest.fixture
def captured() -> Iterator[Captured]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("test.streams.logs")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    logger.addHandler(handler)
    logs.clear()
    yield logger, stream, handler
    logger.removeHandler(handler)
    logs.clear()


def test_json_line_with_bound_fields_and_extra_override(captured: Captured) -> None:
    logger, stream, handler = captured
    handler.setFormatter(logs.JsonFormatter())
    logs.bind(operation_id="op-1", fencing_token=3)
    logger.warning("saved %s", "nothing", extra={"fencing_token": 4, "remote_job_id": "job-9"})
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert record.pop("ts").endswith("Z")
    assert record == {
        "level": "WARNING",
        "logger": "test.streams.logs",
        "message": "saved nothing",
        "operation_id": "op-1",
        "remote_job_id": "job-9",
        "fencing_token": 4,
    }


def test_json_line_without_fields_and_with_exception(captured: Captured) -> None:
    logger, stream, handler = captured
    handler.setFormatter(logs.JsonFormatter())
    try:
        raise RuntimeError("line one\nline two")
    except RuntimeError:
        logger.exception("it broke")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1, "a traceback stays inside the one JSON line"
    record = json.loads(lines[0])
    assert record["message"] == "it broke" and "operation_id" not in record
    assert "RuntimeError: line one\nline two" in record["exception"]


def test_text_line_has_fields_after_the_message_and_traceback_below(captured: Captured) -> None:
    logger, stream, handler = captured
    handler.setFormatter(logs.TextFormatter())
    logs.bind(operation_id="op-2", remote_job_id="job-2", fencing_token=7)
    try:
        raise ValueError("bad")
    except ValueError:
        logger.error("failed", exc_info=True)
    first, *rest = stream.getvalue().splitlines()
    assert first.endswith("ERROR test.streams.logs: failed [operation_id=op-2 remote_job_id=job-2 fencing_token=7]")
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: bad"


def test_bind_none_removes_clear_empties_unknown_refused() -> None:
    logs.clear()
    logs.bind(operation_id="a", fencing_token=1)
    logs.bind(fencing_token=None, remote_job_id="j")
    assert logs.bound() == {"operation_id": "a", "remote_job_id": "j"}
    logs.clear()
    assert logs.bound() == {}
    with pytest.raises(ValueError, match="unknown log field"):
        logs.bind(worker="w")


async def test_each_task_keeps_its_own_fields() -> None:
    seen: dict[str, dict[str, object]] = {}

    async def handle(op: str) -> None:
        logs.clear()
        logs.bind(operation_id=op)
        await asyncio.sleep(0.01)  # the other task binds meanwhile
        logs.bind(fencing_token=len(op))
        await asyncio.sleep(0.01)
        seen[op] = logs.bound()

    await asyncio.gather(handle("op-a"), handle("op-bb"))
    assert seen == {
        "op-a": {"operation_id": "op-a", "fencing_token": 4},
        "op-bb": {"operation_id": "op-bb", "fencing_token": 5},
    }


def test_dict_config_applies_and_refuses_bad_values() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yoyo_level = logging.getLogger("yoyo").level
    try:
        logging.config.dictConfig(logs.dict_config("json", "info", "ext://sys.stderr"))
        assert isinstance(root.handlers[0].formatter, logs.JsonFormatter) and root.level == logging.INFO
        assert logging.getLogger("httpx").level == logging.WARNING
        assert logging.getLogger("yoyo").level == logging.WARNING  # not a line per migration step
        assert not logging.getLogger("yoyo.migrations").isEnabledFor(logging.INFO)
        logging.config.dictConfig(logs.dict_config("text", "ERROR"))
        assert isinstance(root.handlers[0].formatter, logs.TextFormatter)
        assert logging.getLogger("aiokafka").level == logging.ERROR
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.getLogger("yoyo").setLevel(yoyo_level)
    with pytest.raises(ValueError, match="log format 'xml'"):
        logs.dict_config("xml", "INFO")
    with pytest.raises(ValueError, match="not a logging level"):
        logs.dict_config("json", "LOUD")


class Clock:
    """A clock the test moves (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _record(name: str, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_repeats_of_a_library_line_are_held_back_and_counted() -> None:
    clock = Clock()
    repeats = logs.RepeatFilter(window_s=5.0, clock=clock)
    template = "Unable connect to node with id %s: %s"
    passed = []
    for _ in range(12):  # one refused connection every 0.5 s for 6 s
        record = _record("aiokafka.conn", template, 1, "[Errno 111] Connection refused")
        if repeats.filter(record):
            passed.append((clock.now, record.getMessage()))
        clock.now += 0.5
    assert passed == [
        (100.0, "Unable connect to node with id 1: [Errno 111] Connection refused"),
        (105.0, "Unable connect to node with id 1: [Errno 111] Connection refused [9 more like it held back in 5 s]"),
    ]


def test_other_templates_and_loggers_are_not_held_back() -> None:
    repeats = logs.RepeatFilter(window_s=5.0, clock=Clock())
    assert repeats.filter(_record("aiokafka.conn", "Unable connect to node with id %s", 1))
    assert repeats.filter(_record("aiokafka.cluster", "Unable to update metadata from %s", [1]))
    assert repeats.filter(_record("aiokafka.conn", "Unable connect to node with id %s", 2)) is False  # same template
    for _ in range(3):  # the project's own lines are never held back
        assert repeats.filter(_record("streams.worker.stages.observer", "lease %s not renewed", "k"))


def test_the_configured_handler_holds_back_aiokafka_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logging.config.dictConfig(logs.dict_config("json", "INFO", "ext://sys.stderr"))
        for _ in range(20):
            logging.getLogger("aiokafka.conn").error("Unable connect to node with id %s", 1)
            logging.getLogger("streams.worker.stages.observer").warning("lease %s not renewed", "k")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    loggers = [json.loads(line)["logger"] for line in capsys.readouterr().err.splitlines()]
    assert loggers.count("aiokafka.conn") == 1 and loggers.count("streams.worker.stages.observer") == 20
