"""The alerting rules (compose/alerts.yml) pass ``promtool check rules`` and their unit tests
(compose/alerts.test.yml, ``promtool test rules``); every metric they and the dashboard
(compose/grafana-dashboard.json) name is one the product exports.

promtool is built by ``scripts/promtool`` (``.ci/run`` runs it before the tests); without it the promtool tests
are skipped locally and fail in CI (``CI`` set).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest

from streams import metrics  # registers the product's metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "compose" / "alerts.yml"
RULE_TESTS = ROOT / "compose" / "alerts.test.yml"
DASHBOARD = ROOT / "compose" / "grafana-dashboard.json"
PROMTOOL = ROOT / ".data" / "bin" / "promtool"
METRIC_NAME = re.compile(r"\bstreams_[a-z0-9_]+")


def promtool() -> str:
    if PROMTOOL.is_file() and os.access(PROMTOOL, os.X_OK):
        return str(PROMTOOL)
    if os.environ.get("CI"):
        pytest.fail("no promtool in CI: .ci/run must run scripts/promtool before the tests")
    pytest.skip("no promtool (build it with scripts/promtool path)")


def test_promtool_checks_the_rules() -> None:
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert len(rules) >= 9  # the file's rules, each one promtool counted
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout + done.stderr


def test_promtool_unit_tests_of_the_rules() -> None:
    done = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_every_rule_has_a_unit_test() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    tested = {
        t["alertname"]
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in case["alert_rule_test"]
        if t["exp_alerts"]
    }
    assert alerts == tested


def test_the_metrics_page_has_no_created_series_and_passes_promtool() -> None:
    metrics.preinitialise(["t.submissions", "t.polls", "t.cancellations"])
    page = generate_latest().decode()
    samples = [line.split("{")[0].split(" ")[0] for line in page.splitlines() if not line.startswith("#")]
    assert any(name == "streams_submissions_total" for name in samples)  # the preinitialised counters
    assert [name for name in samples if name.endswith("_created")] == []
    done = subprocess.run([promtool(), "check", "metrics"], input=page, capture_output=True, text=True)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def exported_names() -> set[str]:
    """Every sample name this process's registry can export (counters with ``_total``, histograms' parts)."""
    names = set()
    for family in REGISTRY.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def test_rules_and_dashboard_name_only_exported_metrics() -> None:
    exprs = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    exprs += [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    named = {name for e in exprs for name in METRIC_NAME.findall(e)}
    assert len(named) >= 15
    assert named - exported_names() == set()
