"""Reading the Azure LLM inference trace (data/azure-llm-inference-2023)."""

from __future__ import annotations

import csv
import datetime as dt
import io
import itertools
from pathlib import Path

import pytest

from streams_harness.trace import DATA_DIR, TraceFormatError, TraceRow, parse_timestamp, read_trace, trace_path

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


@pytest.mark.parametrize(
    ("trace", "start", "rows", "expected"),
    [
        pytest.param(
            # 2023-11-16 18:15:46.6805900,374,44 / 18:15:50.9951690,396,109 / 18:15:51.2224670,879,55 /
            # 18:15:51.3910170,91,16 / 18:15:52.5732450,91,16
            "conv",
            0,
            5,
            [
                (0, 0.0, 374, 44),
                (1, 4.314579, 396, 109),
                (2, 4.541877, 879, 55),
                (3, 4.710427, 91, 16),
                (4, 5.892655, 91, 16),
            ],
            id="conv-first-rows",
        ),
        pytest.param(
            "conv", 1, 3, [(1, 0.0, 396, 109), (2, 0.227298, 879, 55), (3, 0.395848, 91, 16)], id="conv-slice"
        ),
        pytest.param(
            # 2023-11-16 18:17:03.9799600,4808,10 ... 18:17:04.4249540,34,12
            "code",
            0,
            5,
            [
                (0, 0.0, 4808, 10),
                (1, 0.052, 3180, 8),
                (2, 0.098189, 110, 27),
                (3, 0.140684, 7433, 14),
                (4, 0.444994, 34, 12),
            ],
            id="code-first-rows",
        ),
        pytest.param("code", 3, 2, [(3, 0.0, 7433, 14), (4, 0.30431, 34, 12)], id="code-slice"),
    ],
)
def test_rows_exact_with_arrivals_relative_to_the_slice(
    trace: str, start: int, rows: int, expected: list[tuple[int, float, int, int]]
) -> None:
    assert read_trace(trace, start=start, rows=rows) == [TraceRow(*row) for row in expected]


def test_whole_files() -> None:
    conv = read_trace("conv")
    assert len(conv) == 19_366
    assert conv[-1] == TraceRow(row=19_365, arrival_s=3501.721937, context_tokens=197, generated_tokens=183)
    code = read_trace("code")
    assert len(code) == 8_819
    assert [r.row for r in code[:3]] == [0, 1, 2]
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(code))


def test_slices_past_the_end_and_zero_rows() -> None:
    assert read_trace("conv", start=19_365, rows=10) == [
        TraceRow(row=19_365, arrival_s=0.0, context_tokens=197, generated_tokens=183)
    ]
    assert read_trace("conv", start=19_366) == []
    assert read_trace("conv", rows=0) == []


def test_trace_path() -> None:
    assert trace_path("conv") == DATA_DIR / "AzureLLMInferenceTrace_conv.csv"
    assert trace_path("code") == DATA_DIR / "AzureLLMInferenceTrace_code.csv"
    assert trace_path("conv").is_file()


@pytest.mark.parametrize("name", ["chat", "CONV", "", "missing.csv"])
def test_unknown_name(name: str) -> None:
    with pytest.raises(FileNotFoundError, match="no trace"):
        read_trace(name)


def test_directory_is_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        trace_path(str(tmp_path))


def _write(path: Path, text: str, *, bom: bool) -> Path:
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


@pytest.mark.parametrize("bom", [True, False])
def test_bom_and_crlf_are_handled(tmp_path: Path, bom: bool) -> None:
    body = "\r\n".join(
        [
            HEADER,
            "2023-11-16 18:15:46.6805900,374,44",
            "2023-11-16 18:15:47.0000000,10,0",
            "2023-11-16 18:15:48,5,1",
        ]
    )
    path = _write(tmp_path / "t.csv", body + "\r\n", bom=bom)
    assert read_trace(str(path)) == [
        TraceRow(row=0, arrival_s=0.0, context_tokens=374, generated_tokens=44),
        TraceRow(row=1, arrival_s=0.31941, context_tokens=10, generated_tokens=0),  # kept: exercises the 400 path
        TraceRow(row=2, arrival_s=1.31941, context_tokens=5, generated_tokens=1),
    ]


def test_arrivals_across_midnight(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "m.csv", f"{HEADER}\n2023-11-16 23:59:59.5000000,1,1\n2023-11-17 00:00:01.2500000,2,2\n", bom=True
    )
    assert [r.arrival_s for r in read_trace(str(path))] == [0.0, 1.75]


def _raw_timestamps(trace: str) -> list[str]:
    """The TIMESTAMP column of a real trace file, as written."""
    with trace_path(trace).open("rb") as raw, io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as fh:
        return [rec["TIMESTAMP"] for rec in csv.DictReader(fh)]


@pytest.mark.parametrize(
    ("trace", "first", "last"),
    [
        ("conv", dt.datetime(2023, 11, 16, 18, 15, 46, 680590), dt.datetime(2023, 11, 16, 19, 14, 8, 402527)),
        ("code", dt.datetime(2023, 11, 16, 18, 17, 3, 979960), dt.datetime(2023, 11, 16, 19, 14, 19, 928016)),
    ],
)
def test_the_real_timestamps_are_read_to_the_microsecond(trace: str, first: dt.datetime, last: dt.datetime) -> None:
    written = _raw_timestamps(trace)
    assert written[0] == first.strftime("%Y-%m-%d %H:%M:%S.%f") + "0"  # 7 fractional digits, the 7th a zero
    parsed = [parse_timestamp(value) for value in written]
    assert (parsed[0], parsed[-1]) == (first, last)
    # every row: the microseconds are the first six fractional digits as written
    assert all(ts.strftime("%Y-%m-%d %H:%M:%S.%f") == value[:26] for ts, value in zip(parsed, written, strict=True))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2023-11-16 18:15:46.6805900", dt.datetime(2023, 11, 16, 18, 15, 46, 680590)),
        ("2023-11-16 18:15:46.6805909", dt.datetime(2023, 11, 16, 18, 15, 46, 680590)),  # the 7th digit dropped
        ("2023-11-16T18:15:46.68059", dt.datetime(2023, 11, 16, 18, 15, 46, 680590)),
        ("2023-11-16 18:15:46.5", dt.datetime(2023, 11, 16, 18, 15, 46, 500000)),
        ("2023-11-16 18:15:46", dt.datetime(2023, 11, 16, 18, 15, 46)),
        ("2023-11-16T18:15:46.6805900Z", dt.datetime(2023, 11, 16, 18, 15, 46, 680590)),
        ("2023-11-16 19:15:46.680590+01:00", dt.datetime(2023, 11, 16, 18, 15, 46, 680590)),  # to UTC
        ("2023-11-16 00:15:46-18:00", dt.datetime(2023, 11, 16, 18, 15, 46)),
    ],
)
def test_iso_8601_forms(value: str, expected: dt.datetime) -> None:
    assert parse_timestamp(value) == expected


def test_arrivals_with_and_without_offsets_mix(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "z.csv", f"{HEADER}\n2023-11-16 18:15:46.5,1,1\n2023-11-16T19:15:47.0+01:00,2,2\n", bom=False
    )
    assert [r.arrival_s for r in read_trace(str(path))] == [0.0, 0.5]


@pytest.mark.parametrize(
    "value",
    [
        "16/11/2023 18:15:46",
        "2023-11-16 25:00:00",
        "2023-11-16 18:15:46.",
        "2023-11-16 18:15:46.6805900 UTC",
        "1700158546",
        "",
    ],
)
def test_a_bad_timestamp_is_refused_naming_file_line_and_value(tmp_path: Path, value: str) -> None:
    path = _write(tmp_path / "bad.csv", f"{HEADER}\n2023-11-16 18:15:46.6805900,374,44\n{value},1,1\n", bom=True)
    with pytest.raises(TraceFormatError) as e:
        read_trace(str(path))
    assert str(e.value) == (
        f"trace {path}, line 3: TIMESTAMP {value!r} is not an ISO 8601 date and time (e.g. 2023-11-16 18:15:46.6805900)"
    )


def test_a_row_outside_the_slice_is_not_read(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.csv", f"{HEADER}\nnot a time,1,1\n2023-11-16 18:15:46,2,2\n", bom=False)
    assert read_trace(str(path), start=1) == [TraceRow(row=1, arrival_s=0.0, context_tokens=2, generated_tokens=2)]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("2023-11-16 18:15:46,12x,1", "line 2: ContextTokens '12x' is not a whole number"),
        ("2023-11-16 18:15:46,12", "line 2: GeneratedTokens None is not a whole number"),
    ],
)
def test_a_bad_token_count_is_refused(tmp_path: Path, body: str, message: str) -> None:
    path = _write(tmp_path / "n.csv", f"{HEADER}\n{body}\n", bom=False)
    with pytest.raises(TraceFormatError, match=message):
        read_trace(str(path))


def test_a_missing_column_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.csv", "Timestamp,ContextTokens\n2023-11-16 18:15:46,1\n", bom=False)
    with pytest.raises(TraceFormatError, match="no column TIMESTAMP, GeneratedTokens"):
        read_trace(str(path))
