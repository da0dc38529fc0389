"""Reading the Azure LLM inference trace (data/azure-llm-inference-2023)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from streams_harness.trace import DATA_DIR, TraceRow, read_trace, trace_path

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def test_conv_first_rows_exact() -> None:
    # 2023-11-16 18:15:46.6805900,374,44
    # 2023-11-16 18:15:50.9951690,396,109
    # 2023-11-16 18:15:51.2224670,879,55
    # 2023-11-16 18:15:51.3910170,91,16
    # 2023-11-16 18:15:52.5732450,91,16
    assert read_trace("conv", rows=5) == [
        TraceRow(row=0, arrival_s=0.0, context_tokens=374, generated_tokens=44),
        TraceRow(row=1, arrival_s=4.314579, context_tokens=396, generated_tokens=109),
        TraceRow(row=2, arrival_s=4.541877, context_tokens=879, generated_tokens=55),
        TraceRow(row=3, arrival_s=4.710427, context_tokens=91, generated_tokens=16),
        TraceRow(row=4, arrival_s=5.892655, context_tokens=91, generated_tokens=16),
    ]


def test_conv_start_offsets_are_relative_to_the_slice() -> None:
    assert read_trace("conv", start=1, rows=3) == [
        TraceRow(row=1, arrival_s=0.0, context_tokens=396, generated_tokens=109),
        TraceRow(row=2, arrival_s=0.227298, context_tokens=879, generated_tokens=55),
        TraceRow(row=3, arrival_s=0.395848, context_tokens=91, generated_tokens=16),
    ]


def test_code_first_rows_exact() -> None:
    # 2023-11-16 18:17:03.9799600,4808,10 ... 18:17:04.4249540,34,12
    assert read_trace("code", rows=5) == [
        TraceRow(row=0, arrival_s=0.0, context_tokens=4808, generated_tokens=10),
        TraceRow(row=1, arrival_s=0.052, context_tokens=3180, generated_tokens=8),
        TraceRow(row=2, arrival_s=0.098189, context_tokens=110, generated_tokens=27),
        TraceRow(row=3, arrival_s=0.140684, context_tokens=7433, generated_tokens=14),
        TraceRow(row=4, arrival_s=0.444994, context_tokens=34, generated_tokens=12),
    ]


def test_code_start_offset() -> None:
    assert read_trace("code", start=3, rows=2) == [
        TraceRow(row=3, arrival_s=0.0, context_tokens=7433, generated_tokens=14),
        TraceRow(row=4, arrival_s=0.30431, context_tokens=34, generated_tokens=12),
    ]


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
