"""The real production request trace (Azure LLM inference trace 2023, CC-BY 4.0, see
``streams_harness/data/azure-llm-inference-2023/README.md``).

Each CSV row is one generation request: ``TIMESTAMP`` (arrival, UTC, ``2023-11-16 18:15:46.6805900``: 7
fractional digits; the file starts with a UTF-8 byte-order mark), ``ContextTokens`` and ``GeneratedTokens``.
A row that does not parse raises :class:`TraceFormatError` naming the file, the line and the value.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from streams.errors import StreamsError

#: The trace files, package data of the harness.
DATA_DIR: Traversable = resources.files("streams_harness").joinpath("data", "azure-llm-inference-2023")

#: The columns a trace must have.
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

#: Short trace names -> files.
TRACES = {
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "code": "AzureLLMInferenceTrace_code.csv",
}


@dataclass(frozen=True)
class TraceRow:
    """One request of the trace.

    ``row`` is the 0-based data row index in the file; ``arrival_s`` is seconds since the first row of the
    selected slice.
    """

    row: int
    arrival_s: float
    context_tokens: int
    generated_tokens: int


def trace_path(name_or_path: str) -> Traversable:
    """The CSV path for a trace name (``conv``, ``code``) or a path to a CSV with the same columns.

    Raises:
        FileNotFoundError: neither a known name nor an existing file.
    """
    if name_or_path in TRACES:
        return DATA_DIR / TRACES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"no trace {name_or_path!r}: use one of {sorted(TRACES)} or a CSV path")
    return path


class TraceFormatError(StreamsError):
    """A trace file lacks a column or a row does not parse; the message names the file, the line and the value."""


def parse_timestamp(value: str) -> dt.datetime:
    """A ``TIMESTAMP`` as a naive UTC datetime, read by :meth:`datetime.datetime.fromisoformat` (ISO 8601 as Python
    3.11 reads it: date and time apart by ``T`` or a space, any number of fractional digits, those past the
    microsecond dropped: the trace has 7). With a UTC offset (``Z``, ``+01:00``) it is converted to UTC; without
    one it is UTC already (the trace's).

    Raises:
        ValueError: not an ISO 8601 date and time.
    """
    ts = dt.datetime.fromisoformat(value.strip())
    return ts if ts.tzinfo is None else ts.astimezone(dt.UTC).replace(tzinfo=None)


def read_trace(name_or_path: str, *, start: int = 0, rows: int | None = None) -> list[TraceRow]:
    """Rows ``start .. start+rows-1`` of the trace, with arrivals relative to the first selected row.

    Rows with GeneratedTokens < 1 are kept as they are (they exercise the API's 400 path); rows before ``start``
    are not parsed.

    Raises:
        FileNotFoundError: neither a known trace name nor an existing file.
        TraceFormatError: a column is missing, or a selected row does not parse (:func:`parse_timestamp`, whole
            numbers for the token counts).
    """
    path = trace_path(name_or_path)
    out: list[TraceRow] = []
    first: dt.datetime | None = None
    with path.open("rb") as raw, io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceFormatError(f"trace {path}: no column {', '.join(missing)} (a trace has {', '.join(COLUMNS)})")
        for index, rec in enumerate(reader):
            if index < start:
                continue
            if rows is not None and len(out) >= rows:
                break
            ts, context_tokens, generated_tokens = _parse_row(rec, f"trace {path}, line {reader.line_num}")
            first = first or ts
            out.append(
                TraceRow(
                    row=index,
                    arrival_s=(ts - first).total_seconds(),
                    context_tokens=context_tokens,
                    generated_tokens=generated_tokens,
                )
            )
    return out


def _parse_row(rec: dict[str, str | None], where: str) -> tuple[dt.datetime, int, int]:
    """(arrival, context tokens, generated tokens) of one CSV record; raises :class:`TraceFormatError`."""
    value = rec["TIMESTAMP"]
    try:
        ts = parse_timestamp(value or "")
    except ValueError:
        raise TraceFormatError(
            f"{where}: TIMESTAMP {value!r} is not an ISO 8601 date and time (e.g. 2023-11-16 18:15:46.6805900)"
        ) from None
    counts = []
    for column in COLUMNS[1:]:
        text = rec[column]
        try:
            counts.append(int(text or ""))
        except ValueError:
            raise TraceFormatError(f"{where}: {column} {text!r} is not a whole number") from None
    return ts, counts[0], counts[1]
