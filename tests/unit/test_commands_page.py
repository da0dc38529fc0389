"""docs/commands.md, the captured output of the operators' commands (``scripts/oncall-docs``): it shows every
operator's command ``streams`` has, and no secret or request body."""

from __future__ import annotations

import re

import click

from streams.cli import main
from tests.support import ROOT

PAGE = ROOT / "docs" / "commands.md"

#: The pipeline's own commands, not the operators' (docs/operations.md, "Commands").
NOT_OPERATORS = frozenset({"worker", "submit", "follow"})


def command_paths(group: click.Group, prefix: str = "") -> list[str]:
    """``operations list``, ``purge``, ...: every leaf command under ``group`` (its own, not the plugins')."""
    paths: list[str] = []
    for name, command in sorted(group.commands.items()):
        path = f"{prefix}{name}"
        if isinstance(command, click.Group):
            paths += command_paths(command, path + " ")
        elif path not in NOT_OPERATORS:
            paths.append(path)
    return paths


def test_every_operator_command_has_its_real_output_on_the_page() -> None:
    shown = set(re.findall(r"^\$ streams (?:--\S+ \S+ )?(\S+(?: [a-z][a-z-]*)?)", PAGE.read_text(), re.MULTILINE))
    paths = command_paths(main)
    assert {"operations list", "dead-letters redrive", "purge", "teardown", "migrate"} <= set(paths)
    missing = [p for p in paths if p not in shown and p.split()[0] not in shown]
    assert missing == [], f"re-run scripts/oncall-docs: docs/commands.md lacks {missing}"


def test_the_page_holds_no_secret_and_no_request_body() -> None:
    text = PAGE.read_text()
    assert "streams:streams@" not in text and "PASSWORD" not in text
    assert '"input"' not in text and '"prompt"' not in text
