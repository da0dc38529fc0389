"""The product (``streams``) apart from the harness (``streams_harness``), and the package resources.

The product must run without the harness: no product module imports it (checked statically and in a fresh
interpreter), harness commands reach ``streams`` only through the ``streams.commands`` entry-point group, and
schemas and migrations are read as package resources (``scripts/wheel-check`` checks the built wheel).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from click.testing import CliRunner

import streams
from streams import cli
from streams.errors import MissingResourceError
from streams.setup import admin

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ROOT / "streams"
HARNESS_MODULES = ("streams_harness",)
#: Distributions only the harness depends on (``pyproject.toml``, extra ``harness``); aiohttp is not listed: the
#: product's HTTP transport (``streams/remote/transport.py``) and faust-streaming's web server use it too.
HARNESS_ONLY_IMPORTS = ("honcho",)


def _imported_names(path: Path) -> set[str]:
    """Every module name ``path`` imports (``import x``, ``from x import y``, ``import_module("x")``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def test_the_import_scan_sees_every_kind_of_import(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import a.b\nfrom c import d\nfrom . import e\nimport importlib\n"
        "def f():\n    from g.h import i\n    return importlib.import_module('j.k'), __import__('l')\n"
    )
    assert _imported_names(source) == {"a.b", "c", "importlib", "g.h", "j.k", "l"}


def test_no_product_module_imports_the_harness() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(name for name in _imported_names(path) if name.startswith(prefix))
        for path in sorted(PRODUCT.rglob("*.py"))
        for prefix in (*HARNESS_MODULES, *HARNESS_ONLY_IMPORTS)
        if any(name.startswith(prefix) for name in _imported_names(path))
    }
    assert offenders == {}
    assert len(list(PRODUCT.rglob("*.py"))) > 15  # the scan saw the product


PROBE = """
import importlib, json, pkgutil, sys
import streams, streams.cli
from streams.cli import main
for args in (["worker"], ["migrate"], ["submit"], ["follow"], ["operations", "list"], ["operations", "show"],
             ["operations", "adopt"], ["accounting", "report"]):
    try:
        main([*args, "--help"], prog_name="streams")
    except SystemExit as exc:
        assert exc.code == 0, (args, exc.code)
for info in pkgutil.walk_packages(streams.__path__, "streams."):
    if info.name != "streams.__main__":  # runs the command line
        importlib.import_module(info.name)
import streams.worker.app
streams.worker.app.create_app(streams.config.Settings(web_enabled=False))
print(json.dumps(sorted(sys.modules)))
"""


def test_product_commands_and_the_worker_import_path_load_no_harness_module() -> None:
    """In a fresh interpreter: the product CLI's commands (``--help``), every product module, and a worker's
    app; ``sys.modules`` then holds no harness module."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "streams.worker.app" in modules and "streams.worker.stages.observer" in modules and "faust" in modules
    assert [m for m in modules if m.split(".")[0] in (*HARNESS_MODULES, *HARNESS_ONLY_IMPORTS)] == []


OPERATOR_PROBE = """
import json, sys
from streams.cli import main
for args in (["operations", "list"], ["operations", "show", "op-1"], ["accounting", "report"],
             ["operations", "adopt", "op-1", "job-1", "--reason", "found"], ["operations", "repoll", "op-1"]):
    try:
        main(args, prog_name="streams")
    except BaseException:  # the ledger does not answer here: what matters is what the command imported
        pass
print(json.dumps(sorted(sys.modules)))
"""

#: What the operators' commands never need: faust (the worker's), the HTTP stack and the JSON Schemas (jsonschema
#: with its format checkers takes over a second to import).
NOT_FOR_OPERATORS = ("faust", "mode", "jsonschema", "aiohttp", "httpx")


def test_operator_commands_load_neither_faust_nor_the_http_stack_nor_jsonschema() -> None:
    """In a fresh interpreter, operator commands run until the ledger (unreachable here) refuses them; what they
    imported holds none of :data:`NOT_FOR_OPERATORS`."""
    env = {
        **os.environ,
        "STREAMS_DATABASE_URL": "postgresql://streams:streams@127.0.0.1:1/streams",
        "STREAMS_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    proc = subprocess.run(
        [sys.executable, "-c", OPERATOR_PROBE], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    ran = {"streams.oncall.operations", "streams.ledger.store", "streams.outages", "asyncpg"}
    assert ran <= set(modules)  # they ran
    assert [m for m in modules if m.split(".")[0] in NOT_FOR_OPERATORS] == []


def test_harness_commands_are_offered_through_the_entry_point_group() -> None:
    group = cli.main
    assert isinstance(group, cli.PluginGroup)
    assert set(group.plugin_entry_points()) == {"run", "soak", "bench", "simulator", "replay"}
    product = {
        "migrate",
        "ready",
        "worker",
        "submit",
        "follow",
        "operations",
        "accounting",
        "teardown",
        "purge",
        "dead-letters",
        "config",
    }
    assert set(group.commands) == product  # the product's own
    result = CliRunner().invoke(group, ["--help"])
    assert result.exit_code == 0
    for name in ("run", "soak", "bench", "simulator", "replay", *product):
        assert f"\n  {name} " in result.output


def test_a_command_whose_imports_fail_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    ghost = EntryPoint(name="ghost", value="streams_ghost_module.cli:command", group=cli.COMMANDS_GROUP)
    monkeypatch.setattr(cli.PluginGroup, "plugin_entry_points", staticmethod(lambda: {"ghost": ghost}))
    result = CliRunner().invoke(cli.main, ["ghost", "--rows", "5"])
    assert result.exit_code == 1
    assert "'streams ghost' is not available: No module named 'streams_ghost_module'" in result.output
    assert "[harness]" in result.output
    assert CliRunner().invoke(cli.main, ["nope"]).exit_code == 2  # unknown commands stay usage errors


# --- resources -------------------------------------------------------------------------------------------------


def test_schemas_and_migrations_are_package_resources() -> None:
    from importlib import resources

    assert sorted(p.name for p in resources.files("streams.schemas").iterdir() if p.name.endswith(".json")) == sorted(
        p.name for p in (ROOT / "schemas").glob("*.json")
    )
    ids = [m.id for m in admin.sql_migrations(Path(str(resources.files(admin.MIGRATIONS_PACKAGE))))]
    assert ids == sorted(p.stem for p in (ROOT / "migrations").glob("*.sql") if not p.name.endswith(".rollback.sql"))
    assert "__init__" not in ids


@pytest.mark.parametrize("files", [[], ["__init__.py"], ["__init__.py", "README.md"]])
def test_a_directory_without_sql_migrations_is_an_error(tmp_path: Path, files: list[str]) -> None:
    for name in files:
        (tmp_path / name).write_text('"""not a migration"""\n')
    with pytest.raises(MissingResourceError, match=r"no migration \(\*\.sql\) found in .*reinstall"):
        admin.sql_migrations(tmp_path)


def test_migrate_without_migrations_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """``streams migrate`` exits non-zero, before connecting, when the installation has no migration."""
    monkeypatch.setattr(admin, "MIGRATIONS_PACKAGE", "streams.schemas")  # a package without any *.sql
    monkeypatch.setenv("STREAMS_DATABASE_URL", "postgresql://nobody@127.0.0.1:9/none")  # never reached
    result = CliRunner().invoke(cli.main, ["migrate"])
    assert result.exit_code == 1
    assert "Error: no migration (*.sql) found in" in result.output and "Nothing was applied" in result.output
    monkeypatch.setattr(admin, "MIGRATIONS_PACKAGE", "streams_no_such_package")
    result = CliRunner().invoke(cli.main, ["migrate"])
    assert result.exit_code == 1 and "streams_no_such_package is not installed" in result.output


def test_product_version_is_the_distribution_version() -> None:
    from importlib.metadata import version

    assert streams.__version__ == version("generation-streams")


def test_the_harness_finds_the_clone_it_runs_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streams_harness.checkout import CheckoutNotFoundError, checkout_dir

    assert checkout_dir(ROOT / "tests" / "unit") == ROOT
    monkeypatch.chdir(ROOT / "scripts")
    assert checkout_dir() == ROOT
    with pytest.raises(CheckoutNotFoundError, match=f"no clone of the repository at or above {tmp_path}"):
        checkout_dir(tmp_path)


def test_every_source_directory_is_a_package_of_the_wheel() -> None:
    """Each directory under ``streams/`` and ``streams_harness/`` holding a file is listed in ``pyproject.toml``.

    setuptools installs only the packages it is given, so a subpackage left out of the list is missing from the
    wheel while an editable install still finds it.
    """
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    wanted: set[str] = set()
    data_directories: list[tuple[str, str]] = []
    for top in ("streams", "streams_harness"):
        for directory in [ROOT / top, *(ROOT / top).rglob("*")]:
            if not directory.is_dir() or directory.name == "__pycache__":
                continue
            if not any(child.is_file() and child.suffix != ".pyc" for child in directory.iterdir()):
                continue
            parts = directory.relative_to(ROOT).parts
            if parts[-1].isidentifier():
                wanted.add(".".join(parts))
            else:  # a data directory (no package name possible): its parent package's data must name it
                data_directories.append((".".join(parts[:-1]), parts[-1]))
    missing = sorted(wanted - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"
    for package, name in data_directories:
        patterns = setuptools["package-data"].get(package, [])
        assert any(pattern.startswith(f"{name}/") for pattern in patterns), (package, name, patterns)
