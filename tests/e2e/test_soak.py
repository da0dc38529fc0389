"""The short soak: a few hundred trace rows through three workers with one fault of every kind."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest

from streams_harness.report import broken_promises
from streams_harness.soak import FAULT_KINDS, SoakOptions, run_soak

pytestmark = pytest.mark.e2e


async def test_short_soak_keeps_every_promise(tmp_path: Path) -> None:
    out = io.StringIO()
    report = await run_soak(
        SoakOptions(
            rows=300,
            compression=10.0,
            workers=3,
            faults=len(FAULT_KINDS),
            seed=5,
            report_path=tmp_path / "soak.json",
            timeout_s=420,
            submitting_stale_after_s=30.0,
            submit_retry_deadline_s=8.0,
        ),
        out=out,
    )
    assert broken_promises(report, repeats_allowed=True) == [], out.getvalue()[-4000:]
    assert report["operations_submitted"] == report["operations_in_ledger"] == 300
    injected = report["faults_by_kind"] | report["faults_skipped"]
    assert set(injected) == set(FAULT_KINDS)
    assert sum(report["faults_by_kind"].values()) >= 4  # the worker and network faults always run
    assert "unknown" not in report["uncertain_reasons"]  # every uncertain operation carries its reason
    assert orjson.loads((tmp_path / "soak.json").read_bytes())["state_regressions"] == 0
    # cancellations (3% by default) and completion callbacks with their faults, under the fault plan
    cancels = report["cancellations"]
    assert cancels["asked"] == 9 and cancels["canceled"] > 0
    assert report["canceled_outputs_delivered"] == 0
    callbacks = report["callbacks"]
    assert callbacks["received"] > 0 and callbacks["bad_signature"] > 0 and callbacks["refused_401"] > 0
