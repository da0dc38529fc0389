"""The real production request trace (Azure LLM inference trace 2023, CC-BY 4.0, see
``streams_harness/data/azure-llm-inference-2023/README.md``).

Each CSV row is one generation request: ``TIMESTAMP`` (arrival, UTC, 7 fractional digits; the file starts
with a UTF-8 byte-order mark), ``ContextTokens`` and ``GeneratedTokens``.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

#: The trace files, package data of the harness.
DATA_DIR: Traversable = resources.files("streams_harness").joinpath("data", "azure-llm-inference-2023")

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


def _parse_ts(value: str) -> dt.datetime:
    # 7 fractional digits: Python's %f takes at most 6.
    head, _, frac = value.strip().partition(".")
    base = dt.datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
    return base + dt.timedelta(microseconds=int((frac + "000000")[:6]) if frac else 0)


def read_trace(name_or_path: str, *, start: int = 0, rows: int | None = None) -> list[TraceRow]:
    """Rows ``start .. start+rows-1`` of the trace, with arrivals relative to the first selected row.

    Rows with GeneratedTokens < 1 are kept as they are (they exercise the API's 400 path).
    """
    path = trace_path(name_or_path)
    out: list[TraceRow] = []
    first: dt.datetime | None = None
    with path.open("rb") as raw, io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as fh:
        for index, rec in enumerate(csv.DictReader(fh)):
            if index < start:
                continue
            if rows is not None and len(out) >= rows:
                break
            ts = _parse_ts(rec["TIMESTAMP"])
            first = first or ts
            out.append(
                TraceRow(
                    row=index,
                    arrival_s=(ts - first).total_seconds(),
                    context_tokens=int(rec["ContextTokens"]),
                    generated_tokens=int(rec["GeneratedTokens"]),
                )
            )
    return out
