"""What gets installed, and how: bounded dependencies, lock files with hashes, the Procfile's commands, the version.

The container image's own checks are in ``tests/unit/test_compose.py``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tomllib
from importlib.metadata import version
from pathlib import Path

from click.testing import CliRunner
from packaging.requirements import Requirement

from streams import cli

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
LOCKS = {"product": ROOT / "requirements" / "product.lock", "dev": ROOT / "requirements" / "dev.lock"}


def _requirements() -> list[Requirement]:
    project = PYPROJECT["project"]
    listed = [*project["dependencies"], *PYPROJECT["build-system"]["requires"]]
    for extra in project["optional-dependencies"].values():
        listed += extra
    return [Requirement(text) for text in listed]


def _pins(lock: Path) -> dict[str, str]:
    """Name (normalised) -> pinned version of a pip-compile lock file."""
    return {
        m.group(1).lower().replace("_", "-"): m.group(2)
        for m in re.finditer(r"^([A-Za-z0-9._-]+)==(\S+) \\$", lock.read_text(encoding="utf-8"), re.MULTILINE)
    }


def test_every_dependency_has_an_upper_bound() -> None:
    unbounded = [str(r) for r in _requirements() if not any(s.operator in ("<", "<=", "==", "~=") for s in r.specifier)]
    assert unbounded == []


def test_every_pin_of_the_lock_files_carries_a_hash() -> None:
    for lock in LOCKS.values():
        text = lock.read_text(encoding="utf-8")
        blocks = re.findall(r"^[A-Za-z0-9._-]+==\S+(?: \\\n\s+--hash=sha256:[0-9a-f]{64})*", text, re.MULTILINE)
        assert blocks, lock
        assert all("--hash=sha256:" in block for block in blocks), lock


def test_the_lock_files_hold_every_dependency_within_its_bounds() -> None:
    project = PYPROJECT["project"]
    wanted = {
        "product": [Requirement(t) for t in project["dependencies"]],
        "dev": [
            Requirement(t)
            for t in [
                *project["dependencies"],
                *project["optional-dependencies"]["dev"],
                *project["optional-dependencies"]["harness"],
            ]
        ],
    }
    for name, lock in LOCKS.items():
        pins = _pins(lock)
        for requirement in wanted[name]:
            key = requirement.name.lower().replace("_", "-")
            assert key in pins, f"{lock.name} lacks {key}: run scripts/lock"
            assert requirement.specifier.contains(pins[key], prereleases=True), f"{lock.name}: {key}=={pins[key]}"


def test_the_product_lock_holds_none_of_the_harness_or_dev_tools() -> None:
    pins = _pins(LOCKS["product"])
    for text in ("honcho", "matplotlib", "py-spy", "pytest", "mypy", "ruff", "playwright"):
        assert text not in pins


def test_setup_installs_the_dev_lock_with_hashes_then_the_project_without_dependencies() -> None:
    setup = (ROOT / "scripts" / "setup").read_text(encoding="utf-8")
    assert "pip install -q --require-hashes -r requirements/dev.lock" in setup
    assert "pip install -q --no-deps -e ." in setup
    assert "-e '.[" not in setup


def test_version_prints_the_installed_distributions_version() -> None:
    result = CliRunner().invoke(cli.main, ["--version"], prog_name="streams")
    assert result.exit_code == 0, result.output
    assert result.output == f"streams (generation-streams) {version('generation-streams')}\n"


def test_the_procfile_finds_the_virtualenvs_streams_without_it_on_path() -> None:
    """Each Procfile command, run as honcho runs it (``sh -c`` in the checkout) with only the system's
    directories on PATH, reaches ``.venv/bin/streams`` (asked for ``--version`` instead of its command)."""
    lines = [line for line in (ROOT / "Procfile").read_text(encoding="utf-8").splitlines() if line.strip()]
    assert {line.partition(":")[0] for line in lines} == {"simulator", "worker"}
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    for line in lines:
        command = line.partition(":")[2].strip()
        head, sep, _ = command.partition("streams ")
        assert sep, command
        probe = f"{head}streams --version"
        done = subprocess.run(["sh", "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (shlex.quote(probe), done.stderr)
        assert done.stdout.startswith("streams (generation-streams) ")
