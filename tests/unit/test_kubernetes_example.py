"""compose/kubernetes.yml: the example Deployment probes /livez and /readyz, binds the pod's interfaces, takes
the live view's token from a Secret and sets only known settings."""

from __future__ import annotations

from pathlib import Path

import yaml

from streams.config import Settings
from streams.oncall.webaccess import PROBE_PATHS

MANIFEST = Path(__file__).resolve().parents[2] / "compose" / "kubernetes.yml"


def test_the_deployment_uses_the_probes_and_a_secret_token() -> None:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {"/livez", "/readyz"} <= PROBE_PATHS
    env = {e["name"]: e for e in container["env"]}
    known = {"STREAMS_" + name.upper() for name in Settings.model_fields}
    assert set(env) <= known, set(env) - known
    assert env["STREAMS_WEB_BIND"]["value"] == "0.0.0.0"
    assert "secretKeyRef" in env["STREAMS_WEB_AUTH_TOKEN"]["valueFrom"]
    assert container["ports"][0]["containerPort"] == int(env["STREAMS_WEB_PORT"]["value"])
