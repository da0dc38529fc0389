"""Log lines: one JSON object per line (machines) or one readable line (people), with the operation's fields.

Every record carries, where they apply, the operation id, the remote job id and the fencing value: passed with
``extra={"operation_id": ..., "remote_job_id": ..., "fencing_token": ...}`` or bound for the current task with
:func:`bind` (a :mod:`contextvars` variable, so each agent task and each event handled keeps its own; a handler
calls :func:`clear` before each event). ``extra`` wins over the bound value.

JSON line (``--log-format json``, the default of ``streams worker``)::

    {"ts":"2026-05-02T10:00:00.123Z","level":"WARNING","logger":"streams.worker.stages.observer","message":"...",
     "operation_id":"op-1","remote_job_id":"job-9","fencing_token":4}

Text line (``--log-format text``, the default of the other commands)::

    2026-05-02 10:00:00,123 WARNING streams.observer: [operation_id=op-1 remote_job_id=job-9 fencing_token=4]

The format is chosen with ``--log-format`` or ``STREAMS_LOG_FORMAT`` (``json`` or ``text``).

aiokafka logs every failed connection attempt and metadata refresh of a broker outage, at ERROR: about 290 lines
per worker while a broker restarts for ten seconds. :class:`RepeatFilter` lets the first line of each kind through
and holds back its repeats for :data:`REPEAT_WINDOW_S`; the next line of that kind says how many were held back.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import logging
import time
import types
from collections.abc import Callable, Mapping
from typing import Any

import orjson

#: The fields an operation's log records carry, in output order.
FIELDS = ("operation_id", "remote_job_id", "fencing_token")
_FIELD_SET = frozenset(FIELDS)

#: The accepted values of ``--log-format`` / ``STREAMS_LOG_FORMAT``.
FORMATS = ("json", "text")

#: Environment variable naming the log format.
FORMAT_ENV = "STREAMS_LOG_FORMAT"

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Libraries whose INFO lines are one per request or per migration step: held at WARNING or above.
QUIET_LOGGERS = ("httpx", "aiokafka", "yoyo")

_bound: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "streams_log_fields", default=types.MappingProxyType({})
)


def bind(**fields: Any) -> None:
    """Add ``fields`` (of :data:`FIELDS`) to the current task's log context; a None value removes the field.

    Raises:
        ValueError: a field name is not one of :data:`FIELDS`.
    """
    if not _FIELD_SET.issuperset(fields):
        unknown = set(fields) - _FIELD_SET
        raise ValueError(f"unknown log field(s) {sorted(unknown)}; known: {', '.join(FIELDS)}")
    merged = dict(_bound.get())  # a new mapping: the one set before may be shared with other tasks' contexts
    for name, value in fields.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    _bound.set(merged)


def clear() -> None:
    """Empty the current task's log context (call before handling the next event)."""
    _bound.set({})


def bound() -> dict[str, Any]:
    """The current task's log context (a copy)."""
    return dict(_bound.get())


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The operation fields of ``record``: the bound context, overridden by ``extra=`` values."""
    fields = dict(_bound.get())
    for name in FIELDS:
        value = record.__dict__.get(name)
        if value is not None:
            fields[name] = value
    return {name: fields[name] for name in FIELDS if name in fields}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``, ``message``, the operation
    fields present (:data:`FIELDS`), and ``exception``/``stack`` (text) when the record has them."""

    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        out: dict[str, Any] = {
            "ts": ts,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **record_fields(record),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT`, then the operation fields present as ``[name=value ...]``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = record_fields(record)
        if not fields:
            return line
        suffix = " [" + " ".join(f"{k}={v}" for k, v in fields.items()) + "]"
        first, newline, rest = line.partition("\n")  # keep a traceback below the line
        return first + suffix + newline + rest


#: Seconds during which repeats of one library log line (same logger, same message template) are held back.
REPEAT_WINDOW_S = 5.0
#: Loggers (with their children) whose repeats :class:`RepeatFilter` holds back.
REPEATING_LOGGERS = ("aiokafka",)


class RepeatFilter(logging.Filter):
    """A handler filter: of the records of :data:`REPEATING_LOGGERS`, the first of each (logger name, message
    template) goes through, and its repeats within ``window_s`` seconds are held back (dropped and counted). The
    first one through after the window says how many were held back (``... [37 more like it held back in 5 s]``).
    Records of other loggers always go through. ``clock`` gives seconds (default ``time.monotonic``)."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        #: (logger name, template) -> (when its window opened, repeats held back since).
        self._windows: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(REPEATING_LOGGERS):
            return True
        key = (record.name, str(record.msg))
        now = self.clock()
        window = self._windows.get(key)
        if window is not None and now - window[0] < self.window_s:
            self._windows[key] = (window[0], window[1] + 1)
            return False
        self._windows[key] = (now, 0)
        if window is not None and window[1]:
            record.msg = f"{record.msg} [{window[1]} more like it held back in {self.window_s:g} s]"
        return True


def formatter(fmt: str) -> logging.Formatter:
    """The formatter for ``fmt`` (``json`` or ``text``).

    Raises:
        ValueError: ``fmt`` is not one of :data:`FORMATS`.
    """
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")


def dict_config(fmt: str, level: str | int, stream: str = "ext://sys.stderr") -> dict[str, Any]:
    """A :func:`logging.config.dictConfig` dictionary: one stream handler with the ``fmt`` formatter on the
    root logger at ``level``; ``httpx`` and ``aiokafka`` at WARNING or above (they log every request), ``yoyo``
    too (it logs every step of every migration; ``streams migrate`` prints the ids applied), and aiokafka's
    repeats held back (:class:`RepeatFilter`).

    ``stream`` is a dictConfig reference (``ext://sys.stdout`` for a worker, whose output is its log).

    Raises:
        ValueError: ``fmt`` is not one of :data:`FORMATS`.
    """
    formatter(fmt)  # validates
    numeric = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r} is not a logging level name")
    quiet = max(logging.WARNING, numeric)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"streams": {"()": f"{__name__}.{'JsonFormatter' if fmt == 'json' else 'TextFormatter'}"}},
        "filters": {"repeats": {"()": f"{__name__}.RepeatFilter"}},
        "handlers": {
            "streams": {
                "class": "logging.StreamHandler",
                "formatter": "streams",
                "stream": stream,
                "filters": ["repeats"],
            }
        },
        "root": {"level": numeric, "handlers": ["streams"]},
        "loggers": {name: {"level": quiet} for name in QUIET_LOGGERS},
    }
