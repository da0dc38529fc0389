""".ci/run stops what it started on exit, success or failure, and nothing else: run for real in a copy of the
repository's layout whose scripts are stubs that log each call (the real ones start services and take 30 min).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The standard services as ``scripts/services status`` reports them before the run: postgres ran already.
SERVICES_STATUS = "postgres  up    127.0.0.1:5432  external\nredis     down\nkafka     down\n"


def stub(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/usr/bin/env bash\nLOG="$(dirname "$0")/../calls.log"\n{body}\n')
    path.chmod(0o755)


def sandbox(
    tmp_path: Path, *, main_job_rc: int, promtool_finishes: bool, test_rc: int, toxiproxy_before: bool = True
) -> Path:
    """A copy of ``.ci/run`` beside stub scripts; every stub appends its arguments to ``calls.log``.
    ``toxiproxy_before``: whether ``scripts/toxiproxy status`` finds one answering before the run."""
    (tmp_path / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    scripts = tmp_path / "scripts"
    stub(scripts / "services", f'echo "services $*" >>"$LOG"\n[[ $1 == status ]] && printf "{SERVICES_STATUS}"\ntrue')
    # kafka-secure runs before the run; the others are down.
    stub(
        scripts / "prod-services",
        'echo "prod-services $*" >>"$LOG"\n'
        "if [[ $1 == status ]]; then\n"
        '  if [[ $2 == kafka-secure ]]; then echo "kafka-secure    broker         up    127.0.0.1:19094 pid 1";\n'
        '  else echo "$2 x              down  127.0.0.1:1"; echo "$2 y              down  127.0.0.1:2"; fi\n'
        "fi\ntrue",
    )
    if promtool_finishes:
        stub(scripts / "promtool", 'echo "promtool $*" >>"$LOG"')
    else:  # a build still running when the run fails: it says so once its TERM trap is set
        stub(
            scripts / "promtool",
            'trap \'echo "promtool stopped" >>"$LOG"; exit 143\' TERM\necho "promtool $*" >>"$LOG"\n'
            "while true; do sleep 0.05; done",
        )
    # The main job ends once the promtool build is under way (at most 10 s).
    stub(
        scripts / "main-job",
        f'echo "main-job $*" >>"$LOG"\n'
        'for _ in $(seq 200); do grep -q "^promtool path" "$LOG" && break; sleep 0.05; done\n'
        f"exit {main_job_rc}",
    )
    stub(scripts / "test", f'echo "test $*" >>"$LOG"\nexit {test_rc}')
    status_rc = 0 if toxiproxy_before else 3
    stub(scripts / "toxiproxy", f'echo "toxiproxy $*" >>"$LOG"\n[[ $1 == status ]] && exit {status_rc}\ntrue')
    for name in ("wheel-check", "compose-cli", "chromium"):
        stub(scripts / name, f'echo "{name} $*" >>"$LOG"')
    for name in ("ruff", "mypy", "lint-imports"):
        stub(tmp_path / ".venv" / "bin" / name, "true")
    return tmp_path


def run(root: Path) -> tuple[int, list[str]]:
    done = subprocess.run(["bash", str(root / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    return done.returncode, (root / "calls.log").read_text().splitlines()


def after_main_job(calls: list[str]) -> list[str]:
    return calls[calls.index("main-job --rows 300") + 1 :]


def test_a_failed_main_job_stops_the_services_the_run_started_and_the_promtool_build(tmp_path: Path) -> None:
    root = sandbox(tmp_path, main_job_rc=3, promtool_finishes=False, test_rc=0)
    rc, calls = run(root)
    assert rc == 3
    deadline = time.monotonic() + 10  # the stub logs its own end once its current sleep returns
    while "promtool stopped" not in calls and time.monotonic() < deadline:
        time.sleep(0.05)
        calls = (root / "calls.log").read_text().splitlines()
    stops = sorted(c for c in after_main_job(calls) if c.startswith("services"))
    assert stops == ["services stop kafka", "services stop redis"]  # postgres ran before: left alone
    assert not [c for c in calls if c.startswith("prod-services")]  # none was started
    assert "promtool stopped" in calls


def test_failed_tests_stop_only_the_production_shaped_services_the_run_started(tmp_path: Path) -> None:
    root = sandbox(tmp_path, main_job_rc=0, promtool_finishes=True, test_rc=1)
    rc, calls = run(root)
    assert rc == 1
    tail = calls[calls.index("test --durations=25") + 1 :]
    assert tail[0] == "prod-services down kafka-cluster redis-tls redis-sentinel postgres-tls pgbouncer"
    assert sorted(tail[1:]) == ["services stop kafka", "services stop redis"]


def test_a_successful_run_stops_what_it_started_too(tmp_path: Path) -> None:
    root = sandbox(tmp_path, main_job_rc=0, promtool_finishes=True, test_rc=0)
    rc, calls = run(root)
    assert rc == 0
    ups = [c for c in calls if c.startswith("prod-services up")]
    assert len(ups) == 6  # every one is brought up (kafka-secure reused by prod-services itself)
    tail = calls[calls.index("test --durations=25") + 1 :]
    assert tail[0] == "prod-services down kafka-cluster redis-tls redis-sentinel postgres-tls pgbouncer"
    assert sorted(tail[1:]) == ["services stop kafka", "services stop redis"]


def test_toxiproxy_is_stopped_only_when_none_answered_before_the_run(tmp_path: Path) -> None:
    """The fault tests start Toxiproxy on first use; the run stops it after, but never one that served before it."""
    for before in (False, True):
        root = sandbox(
            tmp_path / str(before), main_job_rc=0, promtool_finishes=True, test_rc=0, toxiproxy_before=before
        )
        rc, calls = run(root)
        assert rc == 0
        toxiproxy = [c for c in calls if c.startswith("toxiproxy")]
        assert toxiproxy == (["toxiproxy status"] if before else ["toxiproxy status", "toxiproxy down"])
        if not before:
            assert calls[-1] == "toxiproxy down"  # after the tests
